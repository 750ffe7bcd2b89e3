#!/usr/bin/env python3
"""Small sets of CUDA calls for scripts/device_check.sh (docs/cuda.md "The device check").

    python3 scripts/device_calls.py memcheck   # a few calls of every operator, small sizes,
                                               # misaligned views and invalid device indices;
                                               # meant to run under compute-sanitizer memcheck
    python3 scripts/device_calls.py sync       # a bf16 moegrad.nn.MoE forward + backward under
                                               # torch.cuda.set_sync_debug_mode("error"), then
                                               # captured in a CUDA graph and replayed

Prints one summary line ("memcheck calls: ..." / "sync check: ...") and exits 0 when every call
ran; a host synchronisation in the sync check raises (exit 1)."""
import sys

import torch

import moegrad

DEV = "cuda"


def rnd(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device=DEV).to(dtype)


def misaligned(t):
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    v = flat[1:].view(t.shape)
    v.copy_(t)
    return v


def memcheck() -> int:
    torch.manual_seed(0)
    R, K, E, H = 37, 4, 16, 96
    n = 0
    for dtype in (torch.float32, torch.bfloat16):
        logits = rnd(R, E, dtype=torch.float32)
        y, idx, norm = moegrad.moe_gating_top_k(logits, K, norm_type=1, out_flag=True,
                                                group_count=4, k_group=2, group_select_mode=1)
        moegrad.moe_gating_top_k_backward(norm, y, idx)
        x = rnd(R, H, dtype=dtype)
        for kw in (dict(expert_num=E), dict(expert_num=E, drop_pad_mode=1, expert_capacity=5),
                   dict(expert_num=E, active_expert_range=[3, 9], expert_tokens_num_type=2),
                   dict(row_idx_type=1)):
            ex, ridx, _ = moegrad.moe_init_routing(x, idx, **kw)
            n += 1
        ex, ridx, counts = moegrad.moe_init_routing(x, idx, expert_num=E)
        moegrad.moe_init_routing_grad(ex, ridx, K)
        pex, pidx, _, _ = moegrad.moe_init_routing(x, idx, expert_num=E, align_block=16)
        moegrad.moe_init_routing_grad(pex, pidx, K, padded_rows=pex.shape[0])
        xs = rnd(R * K, 2 * H, dtype=dtype)
        h = moegrad.swiglu_group(xs, group_index=counts)
        moegrad.swiglu_group(misaligned(xs))
        moegrad.swiglu_group_quant_backward(rnd(R * K, H, dtype=dtype), xs, group_index=counts)
        for mode in (0, 1):
            moegrad.swiglu_group_quant(xs, quant_mode=mode, round_scale=mode == 1,
                                       output_origin=True)
            moegrad.swiglu_group_quant(misaligned(xs), quant_mode=mode, round_scale=True)
        out = moegrad.moe_finalize_routing(h, ridx, scales=y, drop_pad_mode=2, k=K)
        moegrad.moe_finalize_routing_grad(out, ridx, expanded_x=h, scales=y)
        torch.ops.moegrad.moe_finalize_routing_bias_grad(out, idx, y, E)
        bad = ridx.clone()
        bad[::5] = 10**6  # invalid device indices: skipped, never read or written
        moegrad.moe_finalize_routing(h, bad, scales=y, drop_pad_mode=2, k=K)
        moegrad.moe_finalize_routing_grad(out, bad, expanded_x=h, scales=y)
        moegrad.moe_init_routing_grad(ex, bad, K)
        n += 16
    torch.cuda.synchronize()
    print(f"memcheck calls: {n} calls of every operator ran")
    return 0


def step(m, x):
    y = m(x)
    y.float().square().mean().backward()
    return y


def sync() -> int:
    from moegrad.nn import MoE
    if not (hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability()[0] >= 9):
        print("sync check: skipped (torch._grouped_mm on sm90+ is the sync-free expert GEMM)")
        return 0
    torch.manual_seed(0)
    m = MoE(1024, 512, 32, 4, n_group=4, topk_group=2, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(4096, 1024, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    step(m, x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            step(m, x)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(m, x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = step(m, x)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ok = bool(torch.isfinite(y.float()).all())
    print(f"sync check: no host sync in 2 bf16 MoE steps (T=4096, H=1024, E=32, K=4); "
          f"CUDA graph captured and replayed 3x; finite={ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode not in ("memcheck", "sync"):
        sys.exit("usage: device_calls.py memcheck|sync")
    sys.exit(memcheck() if mode == "memcheck" else sync())
