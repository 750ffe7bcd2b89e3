"""`python -m moegrad.bench --layer`: one forward + backward of moegrad.nn.MoE against the same
layer in plain PyTorch, eager and torch.compile (docs/performance.md, "Layer").

The configuration is DeepSeek-V3-like, scaled to one machine (default H=1024, F=512, E=64, K=6,
8 groups keep 4, T=4096, fp32 and bf16). Each step is split into the expert GEMMs (timed on
their own with the same routing: up and down projection, forward and backward) and everything
else (total minus GEMMs). Peak memory of a step: torch.cuda.max_memory_allocated on CUDA; on
the CPU the peak of torch's CPU allocator as recorded by the profiler (allocations minus frees
in event order), against eager. With --losses also the cost of the balance losses (Switch,
sequence-wise, z-loss all on against all off, docs/layer.md "Routing options").
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

import moegrad
from moegrad.nn import MoE, grouped_mm

from .report import progress


# ------------------------------------------------------------------------- plain PyTorch --
class TorchMoELayer(torch.nn.Module):
    """The same layer written the usual way: router, argsort permutation, a GEMM per expert,
    SwiGLU, index_add combine. Parameters are shared with (views of) the moegrad layer's.
    A layer built with activation="clipped_swiglu" is written as transformers' GPT-OSS block:
    router linear with bias, softmax over the top-k logits, expert biases, the interleaved
    clipped SwiGLU (alpha, limit, +offset)."""

    def __init__(self, m: MoE):
        super().__init__()
        self.m = m

    def forward(self, x):
        m = self.m
        if m.activation == "clipped_swiglu":
            return self._gpt_oss(x)
        T, E, K, Fh = x.shape[0], m.num_experts, m.top_k, m.ffn_hidden
        logits = F.linear(x, m.gate).float()
        s = torch.sigmoid(logits)
        sel = (s + m.selection_bias).detach()
        if m.n_group > 1:
            gs = sel.view(T, m.n_group, E // m.n_group).topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(
                1, gs.topk(m.topk_group, dim=-1).indices, True)
            sel = sel.masked_fill(~keep.repeat_interleave(E // m.n_group, 1), float("-inf"))
        idx = sel.topk(K, dim=-1).indices
        w = s.gather(1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * m.routed_scaling_factor
        return self._experts(x, idx, w, lambda up: F.silu(up[:, :Fh]) * up[:, Fh:])

    def _gpt_oss(self, x):
        m = self.m
        lim = m.swiglu_limit
        logits = F.linear(x, m.gate, m.gate_bias).float()
        top_v, idx = logits.topk(m.top_k, dim=-1)
        w = torch.softmax(top_v, dim=-1)

        def act(up):
            gate, lin = up[:, ::2].clamp(max=lim), up[:, 1::2].clamp(-lim, lim)
            return (lin + m.swiglu_offset) * (gate * torch.sigmoid(gate * m.swiglu_alpha))
        return self._experts(x, idx, w, act, m.b_up, m.b_down)

    def _experts(self, x, idx, w, act, b_up=None, b_down=None):
        """The slots sorted by expert (stable argsort), a GEMM per expert on its rows (+ its bias
        row), act over all rows, the down GEMMs, then the weighted index_add combine."""
        m, K = self.m, idx.shape[1]
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = order // K
        sizes = torch.bincount(flat, minlength=m.num_experts).tolist()

        def gemms(rows, weight, bias):
            return torch.cat([r @ weight[e] if bias is None else r @ weight[e] + bias[e]
                              for e, r in enumerate(rows.split(sizes))])
        down = gemms(act(gemms(x[tok], m.w_up, b_up)), m.w_down, b_down)
        scale = w.reshape(-1)[order].to(down.dtype)
        return torch.zeros_like(x).index_add_(0, tok, down * scale[:, None])


# ---------------------------------------------------------------------------------- timing --
def _settle(fn: Callable[[], None]) -> None:
    """The untimed end of a step: fn.reset() where the step has one (a transformers block's
    step frees the weight gradients it left there, which is neither forward nor backward work,
    docs/hf.md). Every timer calls it after each call of fn, warm-up included."""
    reset = getattr(fn, "reset", None)
    if reset is not None:
        reset()


def _time(fn: Callable[[], None], reps: int, sync: Callable[[], None]) -> float:
    fn()                                  # warm-up (and compilation)
    sync()
    _settle(fn)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
        _settle(fn)
    return statistics.median(ts)


def _interleaved(fns: Dict[str, Callable[[], None]], reps: int,
                 sync: Callable[[], None]) -> Dict[str, float]:
    """Median step time of each fn, measured in rounds: one step of each per round, the order
    rotated every round, so that a drift of the machine (load, memory bandwidth phase, the
    allocator's state) reaches every backend alike. Each fn is warmed up (and compiled) first."""
    for fn in fns.values():
        fn()
        sync()
        _settle(fn)
    names = list(fns)
    ts: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(reps):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            t0 = time.perf_counter()
            fns[n]()
            sync()
            ts[n].append(time.perf_counter() - t0)
            _settle(fns[n])
    return {n: statistics.median(v) for n, v in ts.items()}


def _loss_overhead(m: MoE, x, g, reps: int, sync: Callable[[], None]) -> Dict[str, float]:
    """Step time of the layer with the Switch, sequence-wise and z-loss on (their sum added to
    the loss) over the step with all three off, timed in interleaved rounds (_interleaved).
    x is viewed as sequences of 256 tokens (the sequence-wise loss needs [B, S, H])."""
    S = 256 if x.shape[0] % 256 == 0 else x.shape[0]
    xs, gs = x.view(-1, S, x.shape[1]), g.view(-1, S, g.shape[1])
    coefs = ("aux_loss_coef", "seq_aux_loss_coef", "z_loss_coef")

    def step(on: bool):
        for c in coefs:
            setattr(m, c, 1e-3 if on else 0.0)
        xi = xs.detach().requires_grad_(True)
        loss = (m(xi) * gs).sum()
        if on:
            loss = loss + m.aux_loss + m.seq_aux_loss + m.z_loss
        loss.backward()
        m.zero_grad(set_to_none=True)

    ms = _interleaved({"off": lambda: step(False), "on": lambda: step(True)}, reps, sync)
    for c in coefs:
        setattr(m, c, 0.0)
    off, on = ms["off"], ms["on"]
    return dict(losses_off_ms=off * 1e3, losses_on_ms=on * 1e3, losses_overhead=on / off - 1.0)


_PRODUCT_OPS = ("aten::mm", "aten::addmm", "aten::bmm")
_GEMM_OPS = _PRODUCT_OPS + ("aten::_grouped_mm",)


def _inside_gemm(event) -> bool:
    p = event.cpu_parent
    while p is not None:
        if p.name in _GEMM_OPS:
            return True
        p = p.cpu_parent
    return False


def _is_router(event, router_shapes) -> bool:
    """A GEMM event with the router's first two operand shapes (the split counts it as
    non-GEMM)."""
    return tuple(tuple(s) for s in event.input_shapes[:2]) in router_shapes


def _gemm_seconds(events, router_shapes, stub_event: str = "") -> float:
    """GEMM time of one profiled step (the in-step split, L100 / L224): the whole time of every
    outermost GEMM op (one called inside another counts once), those with the router's operand
    shapes excepted, plus the whole time of the ranges named stub_event."""
    g = sum(e.cpu_time_total for e in events if e.name in _GEMM_OPS and not _inside_gemm(e)
            and not _is_router(e, router_shapes))
    if stub_event:
        g += sum(e.cpu_time_total for e in events if e.name == stub_event)
    return g * 1e-6


def _gemm_flops(events, router_shapes) -> float:
    """Floating-point operations (2·m·k·n per product) of the expert GEMMs of one profiled step:
    every `mm`, `addmm` and `bmm`, nested or not (torch's CPU grouped GEMM calls one `mm` per
    expert inside itself), those with the router's operand shapes excepted. A GEMM that calls
    none of these (a fused grouped GEMM) is not counted."""
    total = 0.0
    for e in events:
        if e.name not in _PRODUCT_OPS or _is_router(e, router_shapes):
            continue
        shapes = e.input_shapes[1:] if e.name == "aten::addmm" else e.input_shapes
        if len(shapes) < 2 or not shapes[0] or not shapes[1]:
            continue
        total += 2.0 * math.prod(shapes[0]) * shapes[1][-1]
    return total


def _gemm_rate(dtype, reps: int = 5, n: int = 2048) -> float:
    """FLOP/s of torch.mm on an n x n x n product of dtype on the CPU, median of reps: the
    machine's GEMM rate that the "x eager ceiling" of the hf benchmark divides by (L229)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        ts.append(time.perf_counter() - t0)
    return 2.0 * n ** 3 / statistics.median(ts)


def _in_step_split(fn: Callable[[], None], reps: int, router_shapes,
                   stub_event: str = "") -> Dict[str, float]:
    """CPU: the expert GEMMs' time inside the real step (_gemm_seconds: torch's CPU grouped GEMM
    slices its operands expert by expert inside itself, and that counts as GEMM; the router's
    three GEMMs, recognised by router_shapes, count as non-GEMM; a range named stub_event, where
    a stub stands in for a GEMM, counts as GEMM), and the rest of the step (its wall time minus
    that), medians over reps profiled steps. fn's reset, if any, runs after each profiled step,
    outside the profile. fn is already warm (run_config times it first)."""
    from torch.profiler import ProfilerActivity, profile
    gemm, rest, walls = [], [], []
    flops = 0.0
    for _ in range(reps):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            t0 = time.perf_counter()
            fn()
            wall = time.perf_counter() - t0
        _settle(fn)
        g = _gemm_seconds(prof.events(), router_shapes, stub_event)
        if not flops:  # the same products in every step
            flops = _gemm_flops(prof.events(), router_shapes)
        gemm.append(g)
        rest.append(wall - g)
        walls.append(wall)
    return dict(gemm_ms=statistics.median(gemm) * 1e3, non_gemm_ms=statistics.median(rest) * 1e3,
                step_ms=statistics.median(walls) * 1e3, gemm_gflop=flops * 1e-9)


def _cpu_peak_bytes(fn: Callable[[], None]) -> int:
    """Peak of torch's CPU allocator during fn(), from the profiler's memory events."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    _settle(fn)
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage != 0),
                    key=lambda e: e.time_range.start)
    cur = peak = 0
    for e in events:
        cur += e.self_cpu_memory_usage
        peak = max(peak, cur)
    return peak


def _peak_bytes(fn: Callable[[], None], device: str) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        _settle(fn)
        return peak
    return _cpu_peak_bytes(fn)


def make_layer(arch: str, H, F_, E, K) -> MoE:
    """The benchmarked layer: DeepSeek-V3 style (sigmoid scores, 8 groups with 4 kept when E
    allows, scaling 2.5, SwiGLU) or GPT-OSS (router bias, softmax over the top-k logits, expert
    biases, the interleaved clipped SwiGLU with alpha 1.702, limit 7, +1)."""
    if arch == "gpt_oss":
        m = MoE(H, F_, E, K, score="softmax", activation="clipped_swiglu", expert_bias=True,
                router_bias=True)
        with torch.no_grad():  # transformers starts biases at zero; nonzero ones cost the same
            for b in (m.b_up, m.b_down, m.gate_bias):
                b.normal_(0.0, 0.1)
        return m
    return MoE(H, F_, E, K, score="sigmoid", n_group=8 if E % 8 == 0 else 1,
               topk_group=4 if E % 8 == 0 else 1, routed_scaling_factor=2.5)


def run_config(H, F_, E, K, T, dtype, device, reps, compile_baseline=True, seed=0,
               losses=False, arch="deepseek_v3") -> Dict:
    torch.manual_seed(seed)
    m = make_layer(arch, H, F_, E, K).to(device, dtype)
    ref = TorchMoELayer(m)
    x = torch.randn(T, H, device=device, dtype=dtype)
    g = torch.randn(T, H, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step(layer):
        def f():
            xi = x.detach().requires_grad_(True)
            layer(xi).backward(g)
            m.zero_grad(set_to_none=True)
        return f

    impls = {"moegrad": step(m), "eager": step(ref)}
    if compile_baseline:
        impls["compile"] = step(torch.compile(ref))
    res: Dict = dict(arch=arch, H=H, F=F_, E=E, K=K, T=T,
                     dtype=str(dtype).replace("torch.", ""), device=device)
    for name, fn in impls.items():
        res[f"{name}_ms"] = _time(fn, reps, sync) * 1e3
    # Expert GEMMs alone, same routing: forward + backward of up and down projections.
    with torch.no_grad():
        _, idx, _ = m.route(x)
        counts = torch.bincount(idx.reshape(-1).long(), minlength=E)
    rows = torch.randn(T * K, H, device=device, dtype=dtype)
    rg = torch.randn(T * K, H, device=device, dtype=dtype)

    def gemm_grouped():
        r = rows.detach().requires_grad_(True)
        up = grouped_mm(r, m.w_up, counts)
        grouped_mm(up[:, :F_].contiguous(), m.w_down, counts).backward(rg)
        m.zero_grad(set_to_none=True)

    sizes = counts.tolist()

    def gemm_loop_body(rows_, rg_):
        r = rows_.detach().requires_grad_(True)
        up = torch.cat([a @ m.w_up[e] for e, a in enumerate(r.split(sizes))])
        act = up[:, :F_]
        torch.cat([a @ m.w_down[e] for e, a in enumerate(act.split(sizes))]).backward(rg_)
        m.zero_grad(set_to_none=True)

    def gemm_loop():
        gemm_loop_body(rows, rg)

    res["gemm_grouped_ms"] = _time(gemm_grouped, reps, sync) * 1e3
    res["gemm_loop_ms"] = _time(gemm_loop, reps, sync) * 1e3
    # Each implementation's non-GEMM time is its step minus ITS OWN expert GEMMs: moegrad's
    # grouped_mm, eager's per-expert loop, and that loop compiled (inductor runs the same
    # per-expert mm calls into slices as grouped_mm, without autograd's per-expert zeros).
    res["moegrad_non_gemm_ms"] = res["moegrad_ms"] - res["gemm_grouped_ms"]
    res["eager_non_gemm_ms"] = res["eager_ms"] - res["gemm_loop_ms"]
    if compile_baseline:
        loop_c = torch.compile(gemm_loop_body)
        res["gemm_compile_ms"] = _time(lambda: loop_c(rows, rg), reps, sync) * 1e3
        res["compile_non_gemm_ms"] = res["compile_ms"] - res["gemm_compile_ms"]
    for name in ("eager", "compile"):
        if f"{name}_ms" in res:
            res[f"speedup_vs_{name}"] = res[f"{name}_ms"] / res["moegrad_ms"]
            nm, nb = res["moegrad_non_gemm_ms"], res[f"{name}_non_gemm_ms"]
            res[f"non_gemm_speedup_vs_{name}"] = nb / nm if nm > 0 else float("nan")
    # CPU: the same split measured inside each real step (profiler), which the subtraction
    # above cannot resolve in fp32: there the GEMMs are ~90 % of the step and their run-to-run
    # spread exceeds the whole non-GEMM part. The router's GEMMs count as non-GEMM work.
    if device == "cpu":
        router = {((T, H), (H, E)), ((T, E), (E, H)), ((E, T), (T, H)), ((E,), (T, H))}
        for name, fn in impls.items():
            sp = _in_step_split(fn, reps, router)
            res[f"{name}_in_step_gemm_ms"] = sp["gemm_ms"]
            res[f"{name}_in_step_non_gemm_ms"] = sp["non_gemm_ms"]
            res[f"{name}_profiled_step_ms"] = sp["step_ms"]   # the profiler's own overhead shows
        for name in ("eager", "compile"):
            if f"{name}_in_step_non_gemm_ms" in res:
                res[f"in_step_non_gemm_speedup_vs_{name}"] = (
                    res[f"{name}_in_step_non_gemm_ms"] / res["moegrad_in_step_non_gemm_ms"])
    res["peak_mb_moegrad"] = _peak_bytes(impls["moegrad"], device) / 2**20
    res["peak_mb_eager"] = _peak_bytes(impls["eager"], device) / 2**20
    if losses:
        res.update(_loss_overhead(m, x, g, reps, sync))
    return res


def _fmt(r: Dict) -> str:
    parts = [f"{r.get('arch', 'deepseek_v3')} {r['dtype']:<8} T={r['T']:<5} H={r['H']} "
             f"F={r['F']} E={r['E']} K={r['K']}:",
             f"moegrad {r['moegrad_ms']:8.2f} ms (non-GEMM {r['moegrad_non_gemm_ms']:7.2f})",
             f"eager {r['eager_ms']:8.2f} ms (non-GEMM {r['eager_non_gemm_ms']:7.2f})"]
    if "compile_ms" in r:
        parts.append(f"compile {r['compile_ms']:8.2f} ms (non-GEMM {r['compile_non_gemm_ms']:7.2f})")
    gc = f" / {r['gemm_compile_ms']:.2f} compiled loop" if "gemm_compile_ms" in r else ""
    parts.append(f"GEMMs {r['gemm_grouped_ms']:.2f} grouped / {r['gemm_loop_ms']:.2f} loop{gc} ms")
    if "moegrad_in_step_non_gemm_ms" in r:
        names = [n for n in ("moegrad", "eager", "compile") if f"{n}_in_step_non_gemm_ms" in r]
        parts.append("in-step non-GEMM " + " / ".join(
            f"{n} {r[f'{n}_in_step_non_gemm_ms']:.1f}" for n in names) + " ms")
    parts.append(f"peak {r['peak_mb_moegrad']:.1f} MB vs eager {r['peak_mb_eager']:.1f} MB")
    if "losses_overhead" in r:
        parts.append(f"balance losses {r['losses_on_ms']:.2f} vs {r['losses_off_ms']:.2f} ms "
                     f"({100 * r['losses_overhead']:+.1f} %)")
    return " | ".join(parts)


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m moegrad.bench --layer",
                                description="Time one forward + backward of moegrad.nn.MoE "
                                            "against plain PyTorch (eager, torch.compile).")
    p.add_argument("--layer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--arch", choices=("deepseek_v3", "gpt_oss"), default="deepseek_v3",
                   help="the layer's routing and experts (default deepseek_v3: sigmoid, grouped "
                        "top-k, SwiGLU; gpt_oss: router bias, softmax over the top-k, expert "
                        "biases, clipped SwiGLU)")
    p.add_argument("--hidden", type=int, default=None, help="H (default 1024)")
    p.add_argument("--ffn", type=int, default=None, help="F per expert (default 512)")
    p.add_argument("--experts", type=int, default=None, help="E (default 64; gpt_oss 32)")
    p.add_argument("--top-k", type=int, default=None, help="K (default 6; gpt_oss 4)")
    p.add_argument("--tokens", type=int, default=None, help="T (default 4096)")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 5)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--losses", action="store_true",
                   help="also time the step with every balance loss on against all off")
    p.add_argument("--quick", action="store_true",
                   help="a small configuration (H=128, F=64, E=16, K=4, T=256, 2 reps)")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    sizes = (128, 64, 16, 4, 256, 2) if a.quick else (1024, 512, 64, 6, 4096, 5)
    if a.arch == "gpt_oss" and not a.quick:
        sizes = (1024, 512, 32, 4, 4096, 5)
    for name, v in zip(("hidden", "ffn", "experts", "top_k", "tokens", "reps"), sizes):
        if getattr(a, name) is None:
            setattr(a, name, v)
    dts = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    prev = (torch.get_num_threads(), moegrad.get_num_threads())
    torch.set_num_threads(a.threads)
    moegrad.set_num_threads(a.threads)
    try:
        records = []
        names, t_start = a.dtypes.split(","), time.time()
        for number, name in enumerate(names):
            progress(number, len(names), f"layer {a.arch} {name} H={a.hidden} F={a.ffn} "
                     f"E={a.experts} K={a.top_k} T={a.tokens}", t_start)
            r = run_config(a.hidden, a.ffn, a.experts, a.top_k, a.tokens, dts[name], a.device,
                           a.reps, compile_baseline=not a.no_compile, losses=a.losses,
                           arch=a.arch)
            records.append(r)
            print(_fmt(r))
            sys.stdout.flush()
        if a.json:
            with open(a.json, "w") as f:
                json.dump(dict(meta=dict(torch=torch.__version__, threads=a.threads,
                                         device=a.device), records=records), f, indent=2)
        bad = [r for r in records if not all(math.isfinite(r[k]) for k in
                                             ("moegrad_ms", "eager_ms"))]
        return 1 if bad else 0
    finally:
        torch.set_num_threads(prev[0])
        moegrad.set_num_threads(prev[1])
