"""moegrad.nn.MoE against an independent plain-PyTorch float64 MoE written here.

Routing (sigmoid + selection bias + groups, or softmax), dropless and capacity (drop/pad)
dispatch, SwiGLU experts with clamp, shared experts, the Switch aux loss and the aux-loss-free
bias update; outputs and every parameter gradient; torch.compile.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import moegrad
from moegrad.nn import MoE


def ref_route(x, gate, bias, score, n_group, topk_group, K, rsf):
    logits = x @ gate.t()
    T, E = logits.shape
    s = torch.sigmoid(logits) if score == "sigmoid" else torch.softmax(logits, -1)
    sel = s.detach() + (bias.double() if score == "sigmoid" else 0.0)
    if n_group > 1:
        g = sel.view(T, n_group, E // n_group)
        gs = g.topk(2, -1).values.sum(-1) if score == "sigmoid" else g.max(-1).values
        keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, gs.topk(topk_group, -1).indices,
                                                               True)
        sel = sel.masked_fill(~keep.repeat_interleave(E // n_group, 1), float("-inf"))
    idx = sel.topk(K, -1).indices
    w = s.gather(1, idx)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * rsf
    return w, idx, s


def ref_swiglu(h, F_, clamp):
    a, b = h[..., :F_], h[..., F_:]
    if clamp > 0:
        a, b = a.clamp(max=clamp), b.clamp(-clamp, clamp)
    return F.silu(a) * b


def ref_moe(m: MoE, x, capacity_factor=None):
    """float64, token by token over its K choices (no permutation at all)."""
    d = lambda t: None if t is None else t.double()  # noqa: E731
    x = x.double().reshape(-1, m.hidden)
    gate, up, down = d(m.gate), d(m.w_up), d(m.w_down)
    w, idx, s = ref_route(x, gate, m.selection_bias, m.score, m.n_group, m.topk_group, m.top_k,
                          m.routed_scaling_factor)
    T, K, E, F_ = x.shape[0], m.top_k, m.num_experts, m.ffn_hidden
    keep = torch.ones(T, K, dtype=torch.bool)
    if capacity_factor is not None:
        cap = max(1, math.ceil(capacity_factor * T * K / E))
        seen = [0] * E
        for t in range(T):           # slot order t*K + k: lower tokens win (docs §8.5)
            for k in range(K):
                e = int(idx[t, k])
                keep[t, k] = seen[e] < cap
                seen[e] += 1
    out = torch.zeros_like(x)
    for t in range(T):
        for k in range(K):
            if keep[t, k]:
                e = int(idx[t, k])
                out[t] = out[t] + w[t, k] * (ref_swiglu(x[t] @ up[e], F_, m.clamp_limit) @ down[e])
    if m.shared_up is not None:
        out = out + ref_swiglu(x @ d(m.shared_up), m.shared_hidden, m.clamp_limit) @ d(m.shared_down)
    counts = torch.bincount(idx.reshape(-1), minlength=E).double()
    aux = None
    if m.aux_loss_coef > 0:
        p = s / s.sum(-1, keepdim=True)
        aux = m.aux_loss_coef * E * ((counts / (T * K)) * p.mean(0)).sum()
    return out, idx, aux


def _clone_params_f64(m):
    return {n: p.detach().double().clone().requires_grad_(True) for n, p in m.named_parameters()}


CONFIGS = [
    dict(score="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5),
    dict(score="softmax"),
    dict(score="softmax", n_group=2, topk_group=1, clamp_limit=0.7),
    dict(score="sigmoid", shared_experts=2, aux_loss_coef=0.1),
    dict(score="softmax", capacity_factor=0.8, shared_experts=1),
    dict(score="sigmoid", capacity_factor=4.0),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=[str(i) for i in range(len(CONFIGS))])
def test_layer_matches_float64_reference(cfg, seed):
    torch.manual_seed(seed)
    H, F_, E, K = 12, 8, 8, 2
    m = MoE(H, F_, E, K, **cfg)
    if cfg.get("score") == "sigmoid":
        m.selection_bias.copy_(torch.randn(E) * 0.05)
    x = torch.randn(3, 7, H, requires_grad=True)
    y = m(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    up = torch.randn_like(y)
    loss = (y * up).sum() + (m.aux_loss if m.aux_loss is not None else 0.0)
    loss.backward()

    # The reference, with the same weights in float64 (leaf copies so gradients can be compared).
    ref = MoE(H, F_, E, K, **cfg).double()
    ref.load_state_dict({k: v.double() for k, v in m.state_dict().items()})
    xr = x.detach().double().requires_grad_(True)
    yr, idx_r, aux_r = ref_moe(ref, xr, cfg.get("capacity_factor"))
    lr = (yr * up.double().reshape(-1, H)).sum() + (aux_r if aux_r is not None else 0.0)
    lr.backward()
    _, idx_m, _ = m.route(x.detach().reshape(-1, H))
    assert torch.equal(idx_m.long().sort(-1).values, idx_r.sort(-1).values), "routing differs"
    tol = dict(rtol=1e-4, atol=1e-5)
    assert torch.allclose(y.double().reshape(-1, H), yr, **tol)
    if aux_r is not None:
        assert float(m.aux_loss.detach()) == pytest.approx(float(aux_r.detach()), rel=1e-5)
    assert torch.allclose(x.grad.double(), xr.grad, **tol), "x.grad"
    for (n, p), (_, pr) in zip(m.named_parameters(), ref.named_parameters()):
        assert p.grad is not None, n
        scale = float(pr.grad.abs().max()) + 1e-12
        err = float((p.grad.double() - pr.grad).abs().max())
        assert err <= 1e-4 * scale + 1e-6, f"{n}: max err {err:.3e} vs scale {scale:.3e}"


RETAIN_CONFIGS = CONFIGS + [dict(score="softmax", expert_bias=True, shared_experts=1),
                            dict(score="softmax", expert_bias=True, capacity_factor=1.0)]


@pytest.mark.parametrize("cfg", RETAIN_CONFIGS, ids=[str(i) for i in range(len(RETAIN_CONFIGS))])
def test_retained_graph_second_backward_recomputes_the_up_rows(cfg, seed, monkeypatch):
    """L228: on the CPU the SwiGLU backward writes its gradient over the up GEMM's output
    (routed experts, capacity mode, shared experts, with and without expert biases). Its
    gradients are bitwise those of the operator path (which test_layer_matches_float64_reference
    checks against float64); a second backward through the same graph (retain_graph=True) must
    recompute the overwritten rows and give bitwise the same again; with create_graph the
    first-order gradient is the same."""
    import moegrad.nn.moe as moe_mod
    over = []
    real = moe_mod._swiglu_group_backward_over_x
    monkeypatch.setattr(moe_mod, "_swiglu_group_backward_over_x",
                        lambda gy, up, *a: over.append(up.shape) or real(gy, up, *a))
    torch.manual_seed(seed)
    H, F_, E, K = 12, 8, 8, 2
    m = MoE(H, F_, E, K, **cfg)
    x = torch.randn(3, 7, H, requires_grad=True)
    g = torch.randn(3, 7, H)
    y = m(x)
    grads = []
    for retain in (True, False):
        m.zero_grad(set_to_none=True)
        x.grad = None
        y.backward(g, retain_graph=retain)
        grads.append([x.grad.clone()] + [p.grad.clone() for p in m.parameters()
                                         if p.grad is not None])
    per_backward = 1 + (cfg.get("shared_experts", 0) > 0)
    assert len(over) == 2 * per_backward, over
    assert len(grads[0]) == len(grads[1]) > 1
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    # the operator path (a new gradient tensor) gives the same bits
    monkeypatch.setattr(moe_mod, "_over_up_ok", lambda up: False)
    m.zero_grad(set_to_none=True)
    x.grad = None
    m(x).backward(g)
    assert len(over) == 2 * per_backward
    plain = [x.grad] + [p.grad for p in m.parameters() if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(grads[0], plain))
    monkeypatch.undo()
    # create_graph: the first-order gradient is the same (the operator path, L151)
    gx, = torch.autograd.grad(m(x), x, g, create_graph=True)
    assert torch.allclose(gx, grads[0][0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cfg", RETAIN_CONFIGS, ids=[str(i) for i in range(len(RETAIN_CONFIGS))])
def test_autocast_runs_the_experts_in_its_dtype(cfg, seed):
    """L230: under autocast an fp32 layer's routed and shared experts compute in autocast's dtype
    (as torch's linear would), the router in fp32. With x, the gate and the selection bias
    representable in bf16, the router sees the same values either way, so the output equals
    the same layer converted to bf16 bit for bit, and so do the expert weights' gradients; a
    retained second backward repeats the first."""
    torch.manual_seed(seed)
    H, F_, E, K = 12, 8, 8, 2
    m = MoE(H, F_, E, K, **cfg)
    with torch.no_grad():
        m.selection_bias.copy_(torch.randn(E) * 0.05)
        for t in [m.gate, m.selection_bias] + [p for p in m.parameters()]:
            t.copy_(t.bfloat16().float())
    x = torch.randn(3, 7, H).bfloat16().float().requires_grad_(True)
    g = torch.randn(3, 7, H).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16
    y.backward(g, retain_graph=True)
    first = {n: p.grad.clone() for n, p in m.named_parameters()}
    xg = x.grad.clone()
    y.backward(g)
    assert all(torch.equal(p.grad, 2 * first[n]) for n, p in m.named_parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a bf16 input, as nn.Linear takes it
        assert torch.equal(m(x.detach().bfloat16()), y)
    with pytest.raises(TypeError, match="x: dtype must be the layer's"):
        m(x.detach().bfloat16())  # outside autocast it is refused

    b = MoE(H, F_, E, K, **cfg)
    b.load_state_dict(m.state_dict())
    b = b.bfloat16()
    xb = x.detach().bfloat16().requires_grad_(True)
    yb = b(xb)
    assert torch.equal(y, yb)
    yb.backward(g)
    for n, p in b.named_parameters():
        assert first[n] is not None and first[n].dtype == torch.float32, n
        if n == "gate":  # the router's fp32 gradient, rounded once in the bf16 layer
            assert torch.equal(first[n].bfloat16(), p.grad), n
        else:
            assert torch.equal(first[n], p.grad.float()), n
    scale = xg.abs().max().item()
    assert (xg - xb.grad.float()).abs().max().item() <= 2.0 ** -7 * scale


@pytest.mark.parametrize("retained_first", [False, True], ids=["first", "after_retained"])
def test_swiglu_over_up_under_create_graph_keeps_the_operator_refusal(retained_first):
    """Under create_graph the activation's gradient must carry a graph (the registered operator,
    whose double backward raises, L151), not come from the in-place kernel with none: a silent
    second-order gradient without the SwiGLU terms. Also after a retained backward has
    overwritten the rows: their recomputation must then keep its graph too (the upstream
    gradient here is a constant, so nothing else would record it)."""
    import moegrad.nn.moe as moe_mod
    a = torch.randn(6, 10, requires_grad=True)
    w = torch.randn(10, 10, requires_grad=True)
    gy = torch.randn(6, 5)
    y = moe_mod._SwigluOverUp.apply(a @ w, torch.tensor([2, 4]), -1.0, -1.0, moe_mod._regen_mm,
                                    (a, w))
    if retained_first:
        y.backward(gy, retain_graph=True)
    gw, = torch.autograd.grad(y, w, gy, create_graph=True)
    assert gw.requires_grad
    with pytest.raises(moegrad.MoeError, match="double backward is not supported"):
        torch.autograd.grad(gw.square().sum(), a)


def test_layer_under_fake_tensor_mode_and_dispatch_modes():
    """Shape-only runs (FakeTensorMode, as memory and FLOP estimators use) and op loggers (a
    TorchDispatchMode on real tensors) take the operator path: the in-place kernel would read
    a FakeTensor's missing data, and a logger would not see the SwiGLU backward."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from _util_validation import OpRecorder
    with FakeTensorMode(allow_non_fake_inputs=True):
        m = MoE(16, 8, 4, 2, shared_experts=1, capacity_factor=1.0)
        x = torch.randn(10, 16, requires_grad=True)
        m(x).sum().backward()
        assert x.grad.shape == (10, 16) and m.w_up.grad.shape == m.w_up.shape

    m = MoE(16, 8, 4, 2)
    x = torch.randn(10, 16, requires_grad=True)
    with OpRecorder() as log:
        m(x).sum().backward()
    assert "moegrad.swiglu_group_quant_backward.default" in log.ops


def test_zero_tokens_and_2d_input():
    m = MoE(8, 4, 4, 2)
    x = torch.zeros(0, 8, requires_grad=True)
    y = m(x)
    y.sum().backward()
    assert y.shape == (0, 8) and x.grad.shape == (0, 8)
    assert torch.equal(m.w_up.grad, torch.zeros_like(m.w_up))


def test_bf16_layer_close_to_fp32(seed):
    torch.manual_seed(seed)
    m = MoE(32, 16, 8, 2, n_group=2, topk_group=1)
    m.selection_bias.copy_(torch.randn(8) * 0.01)
    x = torch.randn(64, 32)
    y32 = m(x)
    mb = MoE(32, 16, 8, 2, n_group=2, topk_group=1).to(torch.bfloat16)
    assert mb.selection_bias.dtype == torch.float32 and mb.w_up.dtype == torch.bfloat16
    mb.load_state_dict(m.state_dict())
    yb = mb(x.bfloat16())
    assert yb.dtype == torch.bfloat16
    # bf16 logits may flip near-tied routing choices: compare the tokens routed alike.
    same = (m.last_expert_idx.sort(-1).values == mb.last_expert_idx.sort(-1).values).all(-1)
    assert same.float().mean() > 0.7
    d, r = yb.float()[same] - y32[same].detach(), y32[same].detach()
    assert float(d.norm() / r.norm()) < 3e-2


def test_aux_loss_free_bias_update():
    torch.manual_seed(0)
    m = MoE(8, 4, 4, 1, bias_update_speed=0.01, norm_topk_prob=False)
    m.gate.data.zero_()
    m.gate.data[0] += 1.0                       # expert 0 takes every token with x > 0
    x = torch.ones(10, 8)
    m(x)
    assert m.tokens_per_expert.tolist() == [10.0, 0.0, 0.0, 0.0]
    m.update_bias()
    assert m.selection_bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])
    assert m.tokens_per_expert.sum() == 0


def test_torch_compile_matches_eager(seed):
    torch.manual_seed(seed)
    for cfg in (dict(), dict(capacity_factor=2.0)):
        m = MoE(16, 8, 4, 2, **cfg)
        x = torch.randn(20, 16, requires_grad=True)
        y = m(x)
        y.square().sum().backward()
        gx, gw = x.grad.clone(), m.w_up.grad.clone()
        x.grad = None
        m.zero_grad()
        yc = torch.compile(m, backend="eager")(x)
        yc.square().sum().backward()
        assert torch.allclose(yc, y, atol=1e-6) and torch.allclose(x.grad, gx, atol=1e-5)
        assert torch.allclose(m.w_up.grad, gw, atol=1e-5)


def test_capacity_mode_compiles_without_graph_break():
    m = MoE(16, 8, 4, 2, capacity_factor=1.5)
    explain = torch._dynamo.explain(m)(torch.randn(12, 16))
    assert explain.graph_break_count == 0, explain.break_reasons


@pytest.mark.parametrize("dropless", [True, False])
def test_layer_compiles_without_graph_break(dropless):
    # The dropless expert GEMMs are the opaque operator moegrad::grouped_mm: no graph break.
    m = MoE(16, 8, 4, 2, capacity_factor=None if dropless else 1.5)
    explain = torch._dynamo.explain(m)(torch.randn(12, 16))
    assert explain.graph_break_count == 0, explain.break_reasons


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grouped_mm_against_float64(dtype):
    # Empty experts, a rows tail no expert owns (zero output, zero gradient), random upstream.
    from moegrad.nn import grouped_mm
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    E, A, B = 5, 7, 9
    counts = torch.tensor([3, 0, 4, 1, 0])
    rows = int(counts.sum()) + 2
    x = torch.randn(rows, A, generator=gen).to(dtype).requires_grad_(True)
    w = torch.randn(E, A, B, generator=gen).to(dtype).requires_grad_(True)
    g = torch.randn(rows, B, generator=gen).to(dtype)
    y = grouped_mm(x, w, counts)
    y.backward(g)
    xd, wd = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    owner = torch.repeat_interleave(torch.arange(E), counts)
    yd = torch.zeros(rows, B, dtype=torch.float64)
    for r in range(int(counts.sum())):      # row by row: independent of the slicing
        yd[r] = xd[r] @ wd[owner[r]]
    yd.backward(g.double())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y.double(), yd, **tol)
    torch.testing.assert_close(x.grad.double(), xd.grad, **tol)
    torch.testing.assert_close(w.grad.double(), wd.grad, **tol)
    assert torch.all(y[-2:] == 0) and torch.all(x.grad[-2:] == 0)
    assert torch.all(w.grad[1] == 0) and torch.all(w.grad[4] == 0)


def test_grouped_mm_opcheck_and_errors():
    from moegrad.nn import grouped_mm
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    c = torch.tensor([2, 4])
    torch.library.opcheck(torch.ops.moegrad.grouped_mm, (x, w, c))
    torch.autograd.gradcheck(lambda a, b: grouped_mm(a, b, c), (x, w))
    with pytest.raises(ValueError, match="counts"):
        grouped_mm(x, w, torch.tensor([4, 4]))
    # The host copy of the sizes gives the same bits as the counts themselves.
    y1, y2 = grouped_mm(x, w, c), grouped_mm(x, w, c, c.clone())
    g = torch.randn_like(y1)
    assert torch.equal(y1, y2)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(y1, (x, w), g),
                                                 torch.autograd.grad(y2, (x, w), g)))


def test_grouped_mm_large_outputs():
    # Large outputs (8 MB out, 4 MB grad_x, 4 MB grad_w), an empty expert, against torch; then
    # the operators' huge-page advice (core/host.cc) on ranges it must leave alone.
    from moegrad import _C
    from moegrad.nn import grouped_mm
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    counts = torch.tensor([700, 0, 1348])
    x = torch.randn(2048, 512, generator=gen, requires_grad=True)
    w = torch.randn(3, 512, 1024, generator=gen, requires_grad=True)
    g = torch.randn(2048, 1024, generator=gen)
    y = grouped_mm(x, w, counts)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    ref = torch.cat([x[:700] @ w[0], x[700:] @ w[2]])
    rx, rw = torch.autograd.grad(ref, (x, w), g)
    assert torch.equal(y, ref)
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)
    assert torch.all(gw[1] == 0)
    for p, n in ((0, 0), (0, 1 << 30), (x.data_ptr() + 3, 1000), (x.data_ptr(), x.nbytes)):
        _C._advise_huge_pages(p, n)   # advice only: null, tiny and unaligned ranges are no-ops


_HUGE_PAGE_PROBE = r"""
import sys, torch, moegrad
rows = int(sys.argv[1])
x = torch.randn(rows, 3584)
gx = moegrad.swiglu_group_quant_backward(torch.randn(rows, 1792), x)[0]  # rows * 14 KiB
mid = (gx.data_ptr() + gx.nbytes // 2) & ~((2 << 20) - 1)
vma = None
for line in open("/proc/self/smaps"):
    head = line.split()[0]
    if "-" in head and not head.endswith(":"):
        lo, hi = (int(v, 16) for v in head.split("-"))
        vma = lo <= mid < hi
    elif head == "VmFlags:" and vma:
        print("hg" in line.split()[1:])
        break
"""


def test_huge_page_policy():
    """L223, L225: the smallest output advised, per MOEGRAD_HUGE_PAGES and free page reporting
    (-1: never)."""
    from moegrad import _C
    big = 32 << 20
    for reporting in (False, True):
        assert _C._huge_page_min_bytes("0", reporting) == -1
        assert _C._huge_page_min_bytes("1", reporting) == 0
        assert _C._huge_page_min_bytes("2", reporting) == big
        for unset in (None, "", "yes"):
            assert _C._huge_page_min_bytes(unset, reporting) == (-1 if reporting else big)
    assert isinstance(_C._free_page_reporting(), bool)


def test_free_page_reporting_reads_bit_5(tmp_path):
    """L225: a balloon's features file is '0'/'1' per bit, bit 0 first; bit 5 is free page
    reporting. Any matching device with it set counts; short, empty or missing files do not."""
    from moegrad import _C
    cases = {"rep": "0110010100000000", "norep": "0110000100000000", "short": "01100",
             "empty": ""}
    for name, bits in cases.items():
        d = tmp_path / name / "virtio0"
        d.mkdir(parents=True)
        (d / "features").write_text(bits + "\n")
    got = {n: _C._free_page_reporting(str(tmp_path / n / "*" / "features")) for n in cases}
    assert got == {"rep": True, "norep": False, "short": False, "empty": False}
    assert _C._free_page_reporting(str(tmp_path / "none" / "*" / "features")) is False
    (tmp_path / "norep" / "virtio1").mkdir()
    (tmp_path / "norep" / "virtio1" / "features").write_text(cases["rep"])
    assert _C._free_page_reporting(str(tmp_path / "norep" / "*" / "features")) is True


def _default_advises_large() -> bool:
    from moegrad import _C
    return not _C._free_page_reporting()


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc smaps")
@pytest.mark.parametrize("env, rows, advised", [
    (None, 2048, False), (None, 4096, "default"),  # 29 MB and 59 MB outputs: 32 MiB threshold
    ("0", 4096, False), ("1", 2048, True), ("1", 4096, True), ("2", 2048, False),
    ("2", 4096, True)])
def test_operator_outputs_advised_onto_huge_pages(env, rows, advised):
    """L223, L225: a CPU operator's output gets MADV_HUGEPAGE (VmFlags "hg" on its mapping) by
    default from 32 MiB unless this machine's balloon reports free pages, never with
    MOEGRAD_HUGE_PAGES=0, from two huge pages with =1, from 32 MiB with =2."""
    if advised == "default":
        advised = _default_advises_large()
    e = dict(os.environ)
    e.pop("MOEGRAD_HUGE_PAGES", None)
    if env is not None:
        e["MOEGRAD_HUGE_PAGES"] = env
    out = subprocess.run([sys.executable, "-c", _HUGE_PAGE_PROBE, str(rows)], env=e,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(advised)], out.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_mm_host_counts_do_not_sync_on_cuda():
    # With the sizes already on the host, neither the forward nor the backward of the fallback
    # (fp32 here: not torch._grouped_mm) waits for the device.
    from moegrad.nn import grouped_mm
    x = torch.randn(6, 3, device="cuda", requires_grad=True)
    w = torch.randn(2, 3, 4, device="cuda", requires_grad=True)
    c = torch.tensor([2, 4], device="cuda")
    host = c.cpu()
    g = torch.randn(6, 4, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gx, gw = torch.autograd.grad(grouped_mm(x, w, c, host), (x, w), g)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = torch.cat([x[:2] @ w[0], x[2:] @ w[1]])
    rx, rw = torch.autograd.grad(ref, (x, w), g)
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)


def test_arguments_checked():
    with pytest.raises(ValueError):
        MoE(8, 4, 6, 2, n_group=4)
    with pytest.raises(ValueError):
        MoE(8, 4, 4, 2, score="relu")
    with pytest.raises(ValueError):
        MoE(8, 4, 4, 2)(torch.randn(3, 7))
