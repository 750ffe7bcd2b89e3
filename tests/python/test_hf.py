"""moegrad.hf, the Hugging Face transformers backend (docs/hf.md), on real transformers models.

Every architecture is built from its own config class, tiny and randomly initialised (nothing is
downloaded), then patched with moegrad.hf.apply and compared with an unpatched copy running
transformers' "eager" experts (its own per-expert loop, the reference):
* fp32, whole model: logits, loss, aux loss, router logits and every parameter gradient agree
  (relative 1e-5), the same experts are selected, and 20 AdamW steps give the same loss curve
  (|delta loss| <= 1e-5 at every step);
* bf16, one MoE block: output and gradients against the fp32 block within 4 bf16 ulps or twice
  eager bf16's own error, same experts (inputs drawn without near ties at the top-k boundary,
  where two selections may legitimately differ);
* torch.compile(fullgraph=True) of a patched MoE block (aot_eager: dynamo capture plus the fake
  kernels and autograd; inductor for one architecture);
* the report (what is patched, what is left alone and why), revert, applying twice, the
  from_pretrained path (set_experts_implementation), unmapped activations, a dense model,
  unknown options, mixed dtypes / devices, and importing without transformers.
"""
from __future__ import annotations

import copy
import importlib
import inspect
import os
import subprocess
import sys

import pytest
import torch
import transformers as tf
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

import moegrad
import moegrad.hf as mh
import moegrad.nn.moe as moe_mod

ARCHS = mh.ARCHITECTURES
HAS_CLIPPED = getattr(moegrad, "clipped_swiglu", None) is not None
HAS_NO_RENORM = "no_renorm" in inspect.signature(moegrad.moe_gating_top_k).parameters
FP32_REL = 1e-5
# The numerical comparisons run on the CPU and, where there is a GPU, on CUDA too (the same
# models moved there: moegrad's CUDA kernels against transformers' eager experts on that GPU).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))]


def _build(arch, dtype=torch.float32, **kw):
    """A tiny random model of `arch` with nonzero biases and selection biases (transformers
    initialises some of them to zero, which would hide a missing term)."""
    model = tf.AutoModelForCausalLM.from_config(mh.small_config(arch, **kw),
                                                experts_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name:
                p.normal_(0.0, 0.3)
            elif "experts." in name and p.dim() == 3:
                p.normal_(0.0, 0.3)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0.0, 0.1)
            elif "tid2eid" in name:
                E = model.config.num_local_experts
                b.copy_(torch.stack([torch.randperm(E)[:b.shape[1]] for _ in range(b.shape[0])]))
    return model.to(dtype).train()


def _ids(model, shape):
    """Random token ids without the padding token. Its embedding row is zero, so in the first
    layer its router logits are exactly equal: a tie among all experts that transformers' topk
    and moegrad (the lowest indices, D13) break differently, both correctly."""
    V, pad = model.config.vocab_size, model.config.pad_token_id
    if pad is None or not 0 <= pad < V:
        return torch.randint(0, V, shape)
    t = torch.randint(0, V - 1, shape)
    return t + (t >= pad).long()


def _expected_left_alone(arch):
    """(kind, reason fragment) of the modules the report must list as left alone."""
    out = []
    if arch == "gpt_oss" and not HAS_CLIPPED:
        out.append(("experts", "clipped_swiglu"))
    if arch == "deepseek_v4":
        out.append(("router", "hash routing"))
    return out


def _record_selection(model):
    """Forward hooks on every router: the sorted expert ids of each call."""
    seen = []

    def hook(_m, _inp, out):
        seen.append(torch.sort(out[2].detach().long(), dim=-1).values)
    handles = [m.register_forward_hook(hook) for m in model.modules()
               if type(m).__name__.endswith(("TopKRouter", "TopkRouter", "HashRouter"))]
    return seen, handles


_ROUTER_NAMES = (".gate.", ".router.")


def _is_moe_param(name):
    return _is_router_param(name) or any(s in name for s in ("experts", "shared_expert"))


def _is_router_param(name):
    return any(s in name for s in _ROUTER_NAMES)


# A router's gradient passes through the softmax (or normalised sigmoid) derivative over the
# top-k: each logit's gradient is p_i (g_i - sum_j p_j g_j), a difference of terms that are each
# rounded at their own scale, then summed over tokens. Its rounding noise therefore sits well
# above 1e-5 of the result: over 40 seeds of the GPT-OSS model it reached 0.64 of that bound, and
# one CI draw 1.7 of it. A dropped or wrong router gradient is off by O(1), so 10x still fails it.
ROUTER_REL_FACTOR = 10.0
# Outside the MoE block a gradient is only a downstream consequence of the block's rounding, and
# some are near-cancelling sums (attention biases, DeepSeek-V4's hyper-connection mixers
# hc_fn / hc_base): their error is measured against at least 1e-2 of the model's largest gradient
# element, so the bound there is 1e-7 of it, about one fp32 ulp. With a 1e-3 floor DeepSeek-V4's
# hc_head.hc_fn exceeded the bound in 2 of 40 seeds (1.19x at worst); transformers' own grouped_mm
# backend reaches 0.63x of that bound against eager.
OUTSIDE_FLOOR = 1e-2
# A router's bias gradient is a per-expert sum over tokens of logit gradients of both signs, so it
# can cancel to far below its terms (one CI draw of GPT-OSS: 3.8e-6 against a model maximum near
# 0.2, its rounding 2.7x a bound taken from that cancelled sum). It gets the same floor; over 160
# seeds its error stays under 0.08 of the floored bound, and a dropped bias gradient still fails.


def _floored(name):
    return not _is_moe_param(name) or (_is_router_param(name) and name.endswith(".bias"))


def _check_grads(ref, pat, rel=FP32_REL):
    """Every parameter gradient: relative to the tensor's largest gradient for the MoE block's
    own parameters (routers ROUTER_REL_FACTOR looser); router biases and everything outside the
    block floored at OUTSIDE_FLOOR of the model's largest gradient element (a gradient that is a
    near-cancelling sum carries rounding noise at the scale of its terms)."""
    grads = [(n, p1.grad, p2.grad) for (n, p1), (_, p2) in
             zip(ref.named_parameters(), pat.named_parameters())]
    assert all((g1 is None) == (g2 is None) for _, g1, g2 in grads)
    gmax = max(g1.abs().max().item() for _, g1, _ in grads if g1 is not None)
    assert gmax > 0
    for name, g1, g2 in grads:
        if g1 is None:
            continue
        scale = g1.abs().max().item()
        if _floored(name):
            scale = max(scale, OUTSIDE_FLOOR * gmax)
        tol = rel * (ROUTER_REL_FACTOR if _is_router_param(name) else 1.0)
        err = (g1.float() - g2.float()).abs().max().item()
        assert err <= tol * scale, f"{name}: max |delta grad| {err:.3e} > {tol} * {scale:.3e}"


# --------------------------------------------------------------------------- registration --
def test_import_registers_moegrad():
    assert ALL_EXPERTS_FUNCTIONS["moegrad"] is mh.experts_forward
    assert mh.IMPLEMENTATION == "moegrad"


def test_import_without_transformers_names_the_extra(monkeypatch):
    hidden = {k: v for k, v in sys.modules.items() if k == "transformers"
              or k.startswith("transformers.")}
    for k in hidden:
        monkeypatch.setitem(sys.modules, k, None)
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "moegrad.hf")
    try:
        with pytest.raises(ImportError, match=r"pip install moegrad\[hf\]"):
            importlib.import_module("moegrad.hf")
    finally:
        monkeypatch.undo()
    assert sys.modules["moegrad.hf"] is mh


# ----------------------------------------------------------------- fp32, the whole model ----
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("device", DEVICES)
def test_fp32_model_matches_eager(device, arch, rng):
    ref = _build(arch).to(device)
    pat = copy.deepcopy(ref)
    report = mh.apply(pat)
    expected = _expected_left_alone(arch)
    for kind, fragment in expected:
        assert any(e.kind == kind and fragment in e.detail for e in report.left_alone), \
            str(report)
    assert all(any(e.kind == k and f in e.detail for k, f in expected)
               for e in report.left_alone), str(report)
    assert any(e.kind == "router" for e in report.patched), str(report)
    assert "patched" in str(report)

    ids = _ids(pat, (2, 24)).to(device)
    sel_ref, h1 = _record_selection(ref)
    sel_pat, h2 = _record_selection(pat)
    o1 = ref(ids, labels=ids, output_router_logits=True)
    o2 = pat(ids, labels=ids, output_router_logits=True)
    for h in h1 + h2:
        h.remove()
    assert len(sel_ref) == len(sel_pat) > 0
    for a, b in zip(sel_ref, sel_pat):
        assert torch.equal(a, b), "different experts selected"
    # The router logits transformers' load-balancing loss reads: still returned, equal up to
    # the rounding of the layers before (the router's own linear map is not touched).
    assert len(o1.router_logits) == len(o2.router_logits) > 0
    for a, b in zip(o1.router_logits, o2.router_logits):
        assert (a - b).abs().max() <= FP32_REL * a.abs().max()
    scale = o1.logits.abs().max().item()
    assert (o1.logits - o2.logits).abs().max().item() <= FP32_REL * scale
    assert abs(o1.loss.item() - o2.loss.item()) <= FP32_REL * abs(o1.loss.item())
    if getattr(o1, "aux_loss", None) is not None:
        assert abs(float(o1.aux_loss) - float(o2.aux_loss)) <= FP32_REL * abs(float(o1.aux_loss))
    o1.loss.backward()
    o2.loss.backward()
    _check_grads(ref, pat)


@pytest.mark.parametrize("arch", ARCHS)
def test_autocast_bf16_model_trains_patched(arch, rng):
    """fp32 weights under CPU bf16 autocast: the patched model runs forward and backward (the
    DeepSeek-V3 router adds its fp32 selection bias to the bf16 logits autocast gives it, as
    transformers does), its first router returns the logits the unpatched one returns, every
    gradient the unpatched model gets is there and finite, and the loss is within bf16 rounding of
    transformers' default experts backend (grouped_mm, which like moegrad runs the experts in
    the weights' dtype under autocast, L230). Near-ties can select other experts in bf16
    (docs/hf.md), so only the loss is compared."""
    ref = _build(arch)
    ref.set_experts_implementation("grouped_mm")
    pat = copy.deepcopy(ref)
    mh.apply(pat)
    ids = _ids(pat, (2, 24))
    logits, wdt = [[], []], [[], []]
    handles = [m.register_forward_hook(lambda _m, _i, o, j=j: logits[j].append(o[0].detach())
                                       or wdt[j].append(o[1].dtype))
               for j, model in enumerate((ref, pat)) for m in model.modules()
               if type(m).__name__.endswith(("TopKRouter", "TopkRouter", "HashRouter"))]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        l_ref = ref(ids, labels=ids).loss
        l_pat = pat(ids, labels=ids).loss
    for h in handles:
        h.remove()
    # The first layer's router sees the same input in both models (DeepSeek-V4's first layers
    # route by hash; a later router's input went through bf16 experts, so it may differ).
    assert torch.equal(logits[0][0], logits[1][0])
    assert wdt[0] == wdt[1]  # routing weights in transformers' dtype
    assert abs(l_ref.item() - l_pat.item()) <= 2.0 ** -6 * abs(l_ref.item())
    l_ref.backward()
    l_pat.backward()
    for (n, p1), (_, p2) in zip(ref.named_parameters(), pat.named_parameters()):
        assert (p1.grad is None) == (p2.grad is None), n
        if p2.grad is not None:
            assert p2.grad.dtype == torch.float32 and torch.isfinite(p2.grad).all(), n


def test_autocast_casts_the_input_to_the_weights_dtype(rng):
    """bf16 experts fed fp32 rows under autocast (an fp32 norm output): as transformers'
    grouped_mm backend, the rows are cast to the weights' dtype and the output back to the
    input's (L230), within bf16 rounding of grouped_mm's; outside autocast the same call is a
    moegrad error naming the weight."""
    ref = _build("qwen3_moe", dtype=torch.bfloat16)
    ref.set_experts_implementation("grouped_mm")
    pat = copy.deepcopy(ref)
    mh.apply(pat)
    i, _ = _moe_block(ref)
    e_ref, e_pat = ref.model.layers[i].mlp.experts, pat.model.layers[i].mlp.experts
    N, K = 24, ref.config.num_experts_per_tok
    x = torch.randn(N, ref.config.hidden_size)
    idx = torch.stack([torch.randperm(ref.config.num_experts)[:K] for _ in range(N)])
    w = torch.rand(N, K)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = e_ref(x, idx, w), e_pat(x, idx, w)
    assert a.dtype == b.dtype == torch.float32
    assert (a - b).abs().max().item() <= 4 * 2.0 ** -8 * a.abs().max().item()
    with pytest.raises(moegrad.MoeError, match=r"gate_up_proj: dtype must be hidden_states'"):
        e_pat(x, idx, w)


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_training_loss_curve_matches_eager(arch, rng):
    ref = _build(arch, layers=1)
    pat = copy.deepcopy(ref)
    mh.apply(pat)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, pat)]
    data = _ids(ref, (20, 2, 16))
    worst = 0.0
    for step in range(20):
        losses = []
        for m, opt in zip((ref, pat), opts):
            opt.zero_grad(set_to_none=True)
            loss = m(data[step], labels=data[step], output_router_logits=True).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        worst = max(worst, abs(losses[0] - losses[1]))
        assert abs(losses[0] - losses[1]) <= 1e-5, f"step {step}: {losses}"
    print(f"{arch}: 20 steps, max |delta loss| {worst:.2e}")


# ---------------------------------------------------------------------- bf16, one block -----
def _moe_block(model):
    """The first MoE block of the model (a module with an experts child) and its index."""
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "experts") and not getattr(layer.mlp, "is_hash", False):
            return i, layer.mlp
    raise AssertionError("no MoE block")


def _router(block):
    return getattr(block, "gate", None) or getattr(block, "router")


def _selection_scores(router, logits):
    """What each router ranks, in fp32: the logits (softmax is monotonic), or sigmoid /
    sqrt-softplus scores plus the selection bias (DeepSeek)."""
    bias = getattr(router, "e_score_correction_bias", None)
    if bias is None:
        return logits
    fn = getattr(router, "score_fn", torch.sigmoid)
    return fn(logits) + bias.float()


def _block_inputs(block, H, dtype, k):
    """[2, 16, H] inputs without a near tie at the top-k boundary of what the router ranks: no
    two candidates there within 2^-7 (relative) of each other, so that neither bf16 rounding of
    the scores (DeepSeek-V4's eager router ranks bf16 scores) nor the order of the selection
    decides which experts are taken. Rows are drawn and kept one by one (tokens are routed
    independently): with sigmoid scores up to a quarter of the rows have such a tie, so asking
    all 32 rows of one draw to be tie-free would almost never succeed."""
    router = _router(block)
    kept, n = [], 0
    for _ in range(100):
        x = torch.randn(256, H).to(dtype).to(router.weight.device)
        with torch.no_grad():
            logits = router(x)[0].float()
            sel = _selection_scores(router, logits)
        if k == sel.shape[-1]:
            return x[:32].reshape(2, 16, H)
        top = torch.topk(sel, k + 1, dim=-1).values
        gap = top[:, k - 1] - top[:, k]
        good = x[gap > 2.0 ** -7 * top[:, k - 1].abs()]
        kept.append(good)
        n += good.shape[0]
        if n >= 32:
            return torch.cat(kept)[:32].reshape(2, 16, H)
    raise AssertionError(f"could not draw 32 tie-free rows out of 25600 ({n} found)")


def _call(block, x):
    out = block(x)
    return out[0] if isinstance(out, tuple) else out


def _token_abs_sums(blk, x, g):
    """Per parameter, elementwise, the sum over tokens of |that token's gradient| (fp32 block,
    one token at a time): the magnitude of the terms that a parameter gradient sums. Where they
    cancel (a router bias: each token's logit gradients sum to about zero) the rounding of the
    terms, not the result's size, sets the error."""
    H = x.shape[-1]
    sums = {}
    for xt, gt in zip(x.reshape(-1, H), g.reshape(-1, H)):
        blk.zero_grad(set_to_none=True)
        _call(blk, xt.view(1, 1, H).float()).backward(gt.view(1, 1, H).float())
        for n, p in blk.named_parameters():
            if p.grad is not None:
                sums[n] = sums.get(n, 0) + p.grad.abs()
    blk.zero_grad(set_to_none=True)
    return sums


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("device", DEVICES)
def test_bf16_block_matches_eager(device, arch, rng):
    """bf16 block, patched and eager, each against the same block in fp32 (eager, the bf16
    weights widened): the patched block's error is within 4 bf16 ulps (2^-6) of each tensor's
    magnitude, or at most twice the eager bf16 block's own error where that is larger (the
    DeepSeek-V4 eager router rounds its scores and renormalisation to bf16); a parameter
    gradient element may also be off by 2^-7 of the sum of its per-token terms' magnitudes
    (about two bf16 roundings of each term: a sum of cancelling terms, such as a router bias's,
    is otherwise judged by the size of what is left)."""
    model = _build(arch, dtype=torch.bfloat16).to(device)
    i, ref = _moe_block(model)
    wide = copy.deepcopy(ref).float()
    pat_model = copy.deepcopy(model)
    mh.apply(pat_model)
    pat = pat_model.model.layers[i].mlp
    H, K = model.config.hidden_size, model.config.num_experts_per_tok
    x = _block_inputs(ref, H, torch.bfloat16, K)
    g = torch.randn(2, 16, H).to(torch.bfloat16).to(device)
    runs = []
    for blk, dt in ((wide, torch.float32), (ref, torch.bfloat16), (pat, torch.bfloat16)):
        xi = x.to(dt).clone().requires_grad_(True)
        seen, handles = _record_selection(blk)
        y = _call(blk, xi)
        y.backward(g.to(dt))
        for h in handles:
            h.remove()
        tensors = {"output": y.detach().float(), "input grad": xi.grad.float()}
        tensors.update({n: p.grad.float() for n, p in blk.named_parameters()
                        if p.grad is not None})
        runs.append((seen, tensors))
    (sel32, t32), (sel_ref, t_ref), (sel_pat, t_pat) = runs
    assert all(torch.equal(a, b) for a, b in zip(sel_ref, sel_pat))
    assert all(torch.equal(a, b) for a, b in zip(sel32, sel_pat))
    tol = 4 * 2.0 ** -8
    assert set(t32) == set(t_pat) == set(t_ref)
    terms = _token_abs_sums(wide, x, g)
    for name, truth in t32.items():
        scale = truth.abs().max().item()
        err = (t_pat[name] - truth).abs()
        err_pat = err.max().item()
        err_ref = (t_ref[name] - truth).abs().max().item()
        allowed = torch.full_like(err, max(tol * scale, 2 * err_ref))
        if name in terms:
            allowed = torch.maximum(allowed, 2.0 ** -7 * terms[name])
        worst = int((err - allowed).argmax())
        assert bool((err <= allowed).all()), \
            (f"{arch} {name}: {err_pat:.3e} vs eager bf16 {err_ref:.3e}, scale {scale:.3e}; "
             f"element {worst}: {err.flatten()[worst]:.3e} > {allowed.flatten()[worst]:.3e}")


# ---------------------------------------------------------------------------- compile -------
@pytest.mark.parametrize("arch", ARCHS)
def test_compile_fullgraph_patched_block(arch, rng, monkeypatch):
    if arch == "gpt_oss" and not HAS_CLIPPED:
        monkeypatch.setattr(moegrad, "clipped_swiglu", _clipped_standin, raising=False)
    torch._dynamo.reset()
    model = _build(arch)
    mh.apply(model)
    _, block = _moe_block(model)
    H = model.config.hidden_size
    x = torch.randn(2, 8, H)
    ref = _call(block, x)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    xc = x.clone().requires_grad_(True)
    y = _call(compiled, xc)
    assert (y - ref).abs().max().item() <= FP32_REL * ref.abs().max().item()
    y.sum().backward()
    assert xc.grad is not None and torch.isfinite(xc.grad).all()


def test_compile_inductor_patched_block():
    torch._dynamo.reset()
    model = _build("qwen3_moe")
    mh.apply(model)
    _, block = _moe_block(model)
    x = torch.randn(2, 8, model.config.hidden_size, requires_grad=True)
    y = torch.compile(block, fullgraph=True)(x)
    ref = block(x.detach())
    assert (y - ref).abs().max().item() <= FP32_REL * ref.abs().max().item()
    y.sum().backward()


# ---------------------------------------------------------- the patch: report and undo ------
def test_apply_twice_then_revert():
    ref = _build("qwen3_moe")
    pat = copy.deepcopy(ref)
    r1 = mh.apply(pat)
    r2 = mh.apply(pat)
    assert [e.name for e in r1.patched] == [e.name for e in r2.patched]
    assert any(e.detail == "already patched" for e in r2.patched)
    router = pat.model.layers[0].mlp.gate
    assert type(router) is not type(ref.model.layers[0].mlp.gate)
    assert isinstance(router, type(ref.model.layers[0].mlp.gate))
    assert pat.config._experts_implementation == "moegrad"
    ids = _ids(ref, (2, 8))
    y1 = pat(ids).logits
    restored = r2.revert()
    assert "model.layers.0.mlp.gate" in restored and "model.layers.0.mlp.experts" in restored
    assert type(router) is type(ref.model.layers[0].mlp.gate)
    assert pat.config._experts_implementation == "eager"
    assert not hasattr(pat.model.layers[0].mlp.experts, "_moegrad_plan")
    assert torch.equal(pat(ids).logits, ref(ids).logits)
    assert (y1 - ref(ids).logits).abs().max() <= FP32_REL * y1.abs().max()
    assert mh.revert(pat) == []  # nothing left to undo


def test_experts_only_and_router_only():
    model = _build("mixtral")
    r = mh.apply(model, router=False)
    assert {e.kind for e in r.patched} == {"experts"}
    r.revert()
    r = mh.apply(model, experts=False)
    assert {e.kind for e in r.patched} == {"router"}
    assert model.config._experts_implementation == "eager"


def test_set_experts_implementation_without_apply():
    ref = _build("qwen3_moe")
    pat = copy.deepcopy(ref)
    pat.set_experts_implementation("moegrad")
    ids = _ids(ref, (2, 8))
    a, b = ref(ids).logits, pat(ids).logits
    assert (a - b).abs().max() <= FP32_REL * a.abs().max()


def test_unmapped_activation_keeps_its_own_code():
    ref = _build("qwen3_moe", hidden_act="gelu")
    pat = copy.deepcopy(ref)
    report = mh.apply(pat)
    experts = [e for e in report.left_alone if e.kind == "experts"]
    assert len(experts) == 2 and all("GELU" in e.detail for e in experts), str(report)
    assert {e.kind for e in report.patched} == {"router"}
    # The config is untouched (no experts module maps) and the output is eager's own.
    assert pat.config._experts_implementation == "eager"
    ids = _ids(ref, (2, 8))
    a, b = ref(ids).logits, pat(ids).logits
    assert (a - b).abs().max() <= FP32_REL * a.abs().max()


def test_deepseek_v3_without_renormalisation():
    ref = _build("deepseek_v3", norm_topk_prob=False)
    pat = copy.deepcopy(ref)
    report = mh.apply(pat)
    routers = [e for e in report.left_alone if e.kind == "router"]
    if HAS_NO_RENORM:
        assert not routers
    else:
        assert routers and all("no_renorm" in e.detail for e in routers)
    ids = _ids(ref, (2, 8))
    a, b = ref(ids).logits, pat(ids).logits
    assert (a - b).abs().max() <= FP32_REL * a.abs().max()


def _clipped_standin(x, group_index=None, *, dim=-1, alpha=1.702, limit=7.0, bias=1.0,
                     interleaved=True, clamp_mode=0):
    """The GPT-OSS activation by its formula (torch autograd), standing in for
    moegrad.clipped_swiglu where this build lacks it; rows past sum(group_index) are zero."""
    a, b = (x[..., ::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
    a = a.clamp(max=limit)
    b = b.clamp(-limit, limit)
    y = (b + bias) * a * torch.sigmoid(alpha * a)
    if group_index is not None:
        keep = torch.arange(x.shape[0]) < group_index.sum()
        y = y * keep.unsqueeze(-1).to(y.dtype)
    return y


def test_gpt_oss_experts_layout_and_biases(monkeypatch):
    """The GPT-OSS experts path (transposed weights, both biases, interleaved gate): with the
    activation by its formula when moegrad.clipped_swiglu is absent, so that what the backend
    itself contributes is checked either way."""
    if not HAS_CLIPPED:
        monkeypatch.setattr(moegrad, "clipped_swiglu", _clipped_standin, raising=False)
    ref = _build("gpt_oss")
    pat = copy.deepcopy(ref)
    report = mh.apply(pat)
    assert not report.left_alone, str(report)
    assert all("clipped_swiglu" in e.detail for e in report.patched if e.kind == "experts")
    ids = _ids(ref, (2, 16))
    o1, o2 = ref(ids, labels=ids), pat(ids, labels=ids)
    assert (o1.logits - o2.logits).abs().max() <= FP32_REL * o1.logits.abs().max()
    o1.loss.backward()
    o2.loss.backward()
    _check_grads(ref, pat)
    ex = pat.model.layers[0].mlp.experts
    assert ex.gate_up_proj_bias.grad.abs().sum() > 0 and ex.down_proj_bias.grad.abs().sum() > 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_parallel_off_rank_ids(arch, dtype, rng, monkeypatch):
    """transformers' expert parallelism (`_is_expert_parallel`, L221): local ids, and id E
    (num_experts) for a route to another rank's expert. Against the module's own eager forward
    in float64 with those slots given weight 0 (and any valid id): same output and expert /
    input gradients, the off-rank slots' weight gradients exactly 0 (the masked_fill transformers
    applies), a token routed only off-rank gives 0 and gets no gradient."""
    if arch == "gpt_oss" and not HAS_CLIPPED:
        monkeypatch.setattr(moegrad, "clipped_swiglu", _clipped_standin, raising=False)
    model = _build(arch)
    _, block = _moe_block(model)
    ex = block.experts
    ex._is_expert_parallel = True  # as transformers' expert-parallel styles set it, at load
    report = mh.apply(model)
    assert any(e.name.endswith("experts") for e in report.patched), str(report)
    E, H, N, K = ex.num_experts, model.config.hidden_size, 37, 3
    idx = torch.randint(0, E + 1, (N, K))
    idx[0] = E
    idx[1, 0] = E
    off = idx == E
    x = torch.randn(N, H)
    w = torch.rand(N, K)  # nonzero at the off-rank slots too: the backend must mask them
    g = torch.randn(N, H)

    ref = copy.deepcopy(ex).double()
    ref._is_expert_parallel = False
    xr, wr = x.double().requires_grad_(True), w.double().masked_fill(off, 0.0)
    wr.requires_grad_(True)
    yr = mh._own_forward(ref)(ref, xr, idx.masked_fill(off, 0), wr)
    yr.backward(g.double())
    want = {"output": yr.detach(), "x": xr.grad, "w": wr.grad.masked_fill(off, 0.0)}
    want.update({n: p.grad for n, p in ref.named_parameters()})

    pat = ex.to(dtype)
    xp, wp = x.to(dtype).requires_grad_(True), w.to(dtype).requires_grad_(True)
    yp = pat(xp, idx, wp)
    yp.backward(g.to(dtype))
    got = {"output": yp.detach(), "x": xp.grad, "w": wp.grad}
    got.update({n: p.grad for n, p in pat.named_parameters()})
    assert set(got) == set(want)
    assert torch.equal(got["w"][off], torch.zeros_like(got["w"][off]))
    assert not got["output"][0].any() and not got["x"][0].any()
    with pytest.raises(moegrad.MoeError, match=r"top_k_index: expert ids must be >= 0; got -1"):
        pat(xp, idx.masked_fill(off, -1), wp)
    # bf16: x, the weights, the up rows, the activation and the output are each rounded to 8
    # bits; transformers' own bf16 eager forward reaches up to 1.11 * 2^-6 of the largest value
    # against this float64 truth (450 seeds, the same worst cases as moegrad), so 2^-5.
    rel = FP32_REL if dtype == torch.float32 else 2.0 ** -5
    for name, truth in want.items():
        err = (got[name].double() - truth).abs().max().item()
        scale = truth.abs().max().item()
        assert scale > 0 and err <= rel * scale, f"{arch} {dtype} {name}: {err:.3e} vs {scale:.3e}"


def test_transformers_expert_parallel_two_ranks(tmp_path):
    """transformers' own expert parallelism (DistributedConfig(ep_size=2), gloo, 2 processes)
    on a saved tiny Qwen3-MoE, in both of its modes: with moegrad.hf applied, each rank's loss,
    logits and local gradients (its half of the experts included) equal those of transformers'
    grouped_mm experts in the same run, and the all-reduce mode did send off-rank ids (L221)."""
    pytest.importorskip("accelerate")  # transformers needs it for distributed loading
    model = _build("qwen3_moe")
    model.save_pretrained(tmp_path / "model")
    torch.save(dict(ids=_ids(model, (2, 12))), tmp_path / "case.pt")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_hf_ep_worker.py")
    procs = [subprocess.Popen([sys.executable, worker, str(r), "2", str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(2)]
    try:
        logs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:  # a rank that died leaves its peer waiting in a collective
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    E = model.config.num_experts
    for r in range(2):
        res = torch.load(tmp_path / f"rank{r}.pt")
        for mode, m in res.items():
            assert len(m["patched"]) == model.config.num_hidden_layers, m["report"]
            ref, got = m["ref"], m["got"]
            assert abs(got["loss"] - ref["loss"]) <= FP32_REL * abs(ref["loss"]), mode
            assert (got["logits"] - ref["logits"]).abs().max() <= \
                FP32_REL * ref["logits"].abs().max(), mode
            assert set(got["grads"]) == set(ref["grads"]), mode
            for name, g in ref["grads"].items():
                if "experts" in name:
                    assert g.shape[0] == E // 2, (mode, name, g.shape)
                err = (got["grads"][name] - g).abs().max().item()
                scale = g.abs().max().item()
                tol = FP32_REL * (ROUTER_REL_FACTOR if _is_router_param(name) else 1.0)
                assert err <= tol * max(scale, 1e-30), f"rank {r} {mode} {name}: {err:.3e}"
        assert res["all_reduce"]["off_rank"] > 0 and res["all_to_all"]["off_rank"] == 0


def test_deepseek_v4_hash_layer_reported():
    model = _build("deepseek_v4")
    report = mh.apply(model)
    hashed = [e for e in report.left_alone if e.kind == "router"]
    assert [e.name for e in hashed] == ["model.layers.0.mlp.gate"]
    assert "hash" in hashed[0].detail


# ------------------------------------------------------------------------------ bad input ---
def test_dense_model_is_refused_unchanged():
    cfg = tf.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match="no Mixture-of-Experts block.*nothing was changed"):
        mh.apply(model)
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert not hasattr(model, "_moegrad_hf_state")


def test_options_are_checked():
    model = _build("olmoe")
    with pytest.raises(TypeError):
        mh.apply(model, routers=True)  # unknown option
    with pytest.raises(TypeError, match="router: must be True or False"):
        mh.apply(model, router="yes")
    with pytest.raises(ValueError, match="both False"):
        mh.apply(model, router=False, experts=False)
    with pytest.raises(TypeError, match="model: must be a torch.nn.Module"):
        mh.apply("olmoe")
    assert model.config._experts_implementation == "eager"


def test_mixed_dtypes_and_devices_raise_moegrad_errors():
    model = _build("qwen3_moe")
    mh.apply(model)
    ex = model.model.layers[0].mlp.experts
    H, K = model.config.hidden_size, model.config.num_experts_per_tok
    idx = torch.randint(0, 8, (4, K))
    w = torch.rand(4, K)
    with pytest.raises(moegrad.MoeError, match=r"gate_up_proj: dtype must be .*got torch.float32"):
        ex(torch.randn(4, H, dtype=torch.bfloat16), idx, w)
    with pytest.raises(moegrad.MoeError, match="top_k_weights: must be on hidden_states' device"):
        ex(torch.randn(4, H), idx, w.to("meta"))
    with pytest.raises(moegrad.MoeError, match="top_k_index: must be"):
        ex(torch.randn(4, H), idx[:3], w)
    with pytest.raises(moegrad.MoeError) as info:
        ex(torch.randn(4, H), idx.to(torch.float32), w)
    assert info.value.code == 161002


# ------------------------------------------------------------------------- shared experts ---
def _gated_mlp_reference(x, wg, wu, wd, limit, dtype):
    """The shared expert's eager formula in float64: down(silu(gate) * up), DeepSeek-V4's with
    gate <= limit and |up| <= limit. The projections are rounded to dtype in value only (the
    gradient passes straight through), as both the eager module and the fused path round them
    before the clamp decides: a value within a rounding of the limit must fall on the same side."""
    g, u = x @ wg.T, x @ wu.T
    g = g + (g.to(dtype).double() - g).detach()
    u = u + (u.to(dtype).double() - u).detach()
    if limit > 0:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return (torch.nn.functional.silu(g) * u) @ wd.T


@pytest.mark.parametrize("rows", [0, 1, 37])
@pytest.mark.parametrize("limit", [-1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("frozen", [2, 3])
def test_shared_expert_fused_matches_float64(rows, limit, dtype, frozen, rng):
    """The fused shared expert (L226) against float64 autograd of the formula, random upstream
    gradient, a frozen projection (up or down: its gradient must stay None, the others must
    come)."""
    H, inter = 24, 19
    x = torch.randn(rows, 3, H)
    wg, wu, wd = torch.randn(inter, H) * 0.4, torch.randn(inter, H) * 0.4, torch.randn(H, inter)
    g = torch.randn(rows, 3, H)
    ins = [t.to(dtype).clone().requires_grad_(i != frozen) for i, t in enumerate((x, wg, wu, wd))]
    y = mh._GatedMLP.apply(*ins, limit)
    y.backward(g.to(dtype))
    ref = [t.to(dtype).double().requires_grad_(i != frozen)
           for i, t in enumerate((x, wg, wu, wd))]
    y64 = _gated_mlp_reference(ref[0].reshape(-1, H), *ref[1:], limit, dtype).reshape(rows, 3, H)
    y64.backward(g.double())
    assert ins[frozen].grad is None and y.shape == (rows, 3, H) and y.dtype == dtype
    # Relative to each tensor's largest element. Over 200 seeds at 37 rows the worst was
    # 7.9e-7 in fp32 and 1.1e-2 in bf16 (2^-5 is 8 bf16 ulps).
    tol = FP32_REL if dtype == torch.float32 else 2.0 ** -5
    pairs = [(y, y64)] + [(a.grad, b.grad) for a, b in zip(ins, ref) if a.requires_grad]
    for got, want in pairs:
        assert got.shape == want.shape
        if want.numel():
            err = (got.double() - want).abs().max().item()
            assert err <= tol * want.abs().max().item(), (err, want.abs().max().item())
    if limit > 0 and rows:  # the clamp is active somewhere, or the case tests nothing
        pre = ref[0].reshape(-1, H) @ ref[1].T
        assert (pre > limit).any()


@pytest.mark.parametrize("over_up", [False, True], ids=["new", "over_up"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clamp_gradient_passes_at_the_limit(dtype, over_up, rng):
    """L227: DeepSeek-V4's clamps are torch.clamp, whose gradient passes at exactly the limit;
    both clamped paths of the backend (the routed experts' activation and the shared expert)
    must give it there, where swiglu_group's own strict mask (D11) gives none, whether the
    activation's gradient goes to a new tensor or over the up rows (L228). Identity
    projections put gate and up values exactly on +-limit (0.75, exact in bf16)."""
    c, n = 0.75, 16
    x = torch.randn(9, n).clamp(-2, 2)
    x[0, :4] = c
    x[1, :4] = -c
    x[2, 4:8] = c
    eye = torch.eye(n)
    g = torch.randn(9, n)
    # The shared expert with gate = up = x.
    ins = [t.to(dtype).clone().requires_grad_(True) for t in (x, eye, eye, eye)]
    mh._GatedMLP.apply(*ins, c).backward(g.to(dtype))
    ref = [t.to(dtype).double().requires_grad_(True) for t in (x, eye, eye, eye)]
    _gated_mlp_reference(*ref, c, dtype).backward(g.double())
    # The routed experts' activation on [gate | up] rows.
    up = torch.cat([x, x.flip(0)], 1).to(dtype).requires_grad_(True)
    counts = torch.tensor([4, 5])
    gy = torch.randn(9, n)
    if over_up:  # up * 1: the tensor the backward overwrites is not the leaf
        eye2 = torch.eye(2 * n, dtype=dtype).expand(2, -1, -1)
        act = mh._SwigluOverUp.apply(up * 1, counts, c, mh._inclusive(c), mh._regen_up,
                                     (up, eye2, None))
    else:
        act = mh._SwigluOverUp.apply(up, counts, c, mh._inclusive(c), None, ())
    act.backward(gy.to(dtype))
    u64 = up.detach().double().requires_grad_(True)
    gate, upper = u64.chunk(2, -1)
    (torch.nn.functional.silu(gate.clamp(max=c)) * upper.clamp(-c, c)).backward(gy.double())
    tol = FP32_REL if dtype == torch.float32 else 2.0 ** -5
    at_limit = (x.abs() == c)
    assert at_limit.sum() >= 12
    for got, want in ((ins[0].grad, ref[0].grad), (up.grad, u64.grad)):
        err = (got.double() - want).abs().max().item()
        assert err <= tol * want.abs().max().item(), err
    # the rows holding limit values have a nonzero reference gradient there (the case bites)
    assert (ref[0].grad[:3].abs() > 0).sum() >= 12


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v4"])
def test_retained_graph_second_backward_recomputes_the_up_rows(arch, rng, monkeypatch):
    """L228: on the CPU the routed experts' activation gradient is written over the up GEMM's
    output. A second backward through the same graph (retain_graph=True) finds it overwritten
    and must recompute it: both backwards give bitwise the same gradients, and those agree with
    the eager experts' (plain SwiGLU, and DeepSeek-V4's clamp)."""
    over = []
    real = moe_mod._swiglu_group_backward_over_x
    monkeypatch.setattr(moe_mod, "_swiglu_group_backward_over_x",
                        lambda gy, up, *a: over.append(up.data_ptr()) or real(gy, up, *a))
    model = _build(arch)
    i, ref = _moe_block(model)
    pat_model = copy.deepcopy(model)
    mh.apply(pat_model)
    pat = pat_model.model.layers[i].mlp
    H = model.config.hidden_size
    x, g = torch.randn(2, 16, H), torch.randn(2, 16, H)
    runs = []
    for blk in (ref, pat):
        xi = x.clone().requires_grad_(True)
        y = _call(blk, xi)
        grads = []
        for retain in (True, False):
            blk.zero_grad(set_to_none=True)
            xi.grad = None
            y.backward(g, retain_graph=retain)
            grads.append({"input": xi.grad.clone(), **{n: p.grad.clone() for n, p in
                                                       blk.named_parameters() if p.grad is not None}})
        runs.append(grads)
    assert len(over) == 2, "the patched backward writes the gradient over the up rows"
    (ref1, ref2), (pat1, pat2) = runs
    assert set(pat1) == set(pat2) == set(ref1)
    for name in pat1:
        assert torch.equal(pat1[name], pat2[name]), name
        scale = ref1[name].abs().max().item()
        err = (pat1[name] - ref1[name]).abs().max().item()
        rel = FP32_REL * (ROUTER_REL_FACTOR if _is_router_param("." + name) else 1.0)
        assert err <= rel * max(scale, 1e-30), (name, err, scale)


def test_shared_expert_second_order_and_transforms(rng):
    """Double backward through the fused shared expert raises instead of dropping terms;
    torch.func (vmap) and forward-mode AD run the module's own code and agree with it."""
    ref = _build("qwen2_moe")
    pat = copy.deepcopy(ref)
    mh.apply(pat)
    mlp, mlp_ref = pat.model.layers[0].mlp.shared_expert, ref.model.layers[0].mlp.shared_expert
    H = ref.config.hidden_size
    x = torch.randn(4, H, requires_grad=True)
    (gx,) = torch.autograd.grad(mlp(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|differentiate"):
        torch.autograd.grad(gx.sum(), x)
    xs = torch.randn(3, 4, H)
    assert torch.allclose(torch.func.vmap(mlp)(xs), torch.func.vmap(mlp_ref)(xs), atol=1e-6)
    import torch.autograd.forward_ad as fwad
    t = torch.randn(4, H)
    outs = []
    for m in (mlp, mlp_ref):
        with fwad.dual_level():
            outs.append(fwad.unpack_dual(m(fwad.make_dual(x.detach(), t))).tangent)
    assert torch.allclose(outs[0], outs[1], atol=1e-6)
    # an activation hooked after apply is honoured
    for m in (mlp, mlp_ref):
        m.act_fn.register_forward_hook(lambda _m, _i, o: o * 3.0)
    assert torch.allclose(mlp(x), mlp_ref(x), atol=1e-6)


def test_shared_expert_patch_reports_and_falls_back(rng):
    """Qwen2-MoE's gated shared expert: reported patched, output equal to eager; a projection
    hooked or replaced after apply (an adapter), or autocast, runs the module's own forward;
    a weight of another dtype is a moegrad error naming it; revert restores the class; a
    biased projection is left alone with the reason."""
    ref = _build("qwen2_moe")
    pat = copy.deepcopy(ref)
    report = mh.apply(pat)
    shared = [e for e in report.patched if e.kind == "shared"]
    assert [e.name for e in shared] == [f"model.layers.{i}.mlp.shared_expert" for i in (0, 1)]
    assert "swiglu_group" in shared[0].detail
    again = [e for e in mh.apply(pat).patched if e.kind == "shared"]
    assert [(e.name, e.detail) for e in again] == [(e.name, "already patched") for e in shared]
    ids = _ids(ref, (2, 12))
    ref_logits = ref(ids).logits
    assert (pat(ids).logits - ref_logits).abs().max() <= FP32_REL * ref_logits.abs().max()
    mlp, mlp_ref = pat.model.layers[0].mlp.shared_expert, ref.model.layers[0].mlp.shared_expert
    x = torch.randn(5, ref.config.hidden_size)
    # A hook that changes a projection's output must be honoured (not fused away).
    hooks = [m.gate_proj.register_forward_hook(lambda _m, _i, o: o * 2.0)
             for m in (mlp, mlp_ref)]
    assert torch.allclose(mlp(x), mlp_ref(x), rtol=1e-6, atol=1e-6)
    for h in hooks:
        h.remove()
    # A backward hook on a projection must still fire.
    fired = []
    h = mlp.down_proj.register_full_backward_hook(lambda *_: fired.append(1))
    mlp(x.clone().requires_grad_()).sum().backward()
    h.remove()
    assert fired == [1]

    class Adapter(torch.nn.Module):  # LoRA-like: the layer plus a low-rank term
        def __init__(self, base):
            super().__init__()
            self.base, self.a = base, torch.nn.Linear(base.in_features, base.out_features,
                                                      bias=False)

        def forward(self, t):
            return self.base(t) + self.a(t)
    mlp.up_proj, mlp_ref.up_proj = Adapter(mlp.up_proj), Adapter(mlp_ref.up_proj)
    mlp.up_proj.a.weight.data.copy_(mlp_ref.up_proj.a.weight.data)
    assert torch.allclose(mlp(x), mlp_ref(x), rtol=1e-6, atol=1e-6)
    mlp.up_proj, mlp_ref.up_proj = mlp.up_proj.base, mlp_ref.up_proj.base
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(mlp(x), mlp_ref(x))
    mlp.down_proj.to(torch.bfloat16)
    with pytest.raises(moegrad.MoeError, match=r"down_proj.weight: dtype must be"):
        mlp(x)
    mlp.down_proj.float()
    restored = report.revert()
    assert "model.layers.0.mlp.shared_expert" in restored
    assert type(mlp) is type(mlp_ref) and not hasattr(mlp, "_moegrad_kind")

    biased = copy.deepcopy(ref)
    lin = biased.model.layers[1].mlp.shared_expert.gate_proj
    lin.bias = torch.nn.Parameter(torch.zeros(lin.out_features))
    left = [e for e in mh.apply(biased).left_alone if e.kind == "shared"]
    assert [e.name for e in left] == ["model.layers.1.mlp.shared_expert"]
    assert "bias" in left[0].detail


# --------------------------------------------------------------------- demo --hf ARCH -------
# Three architectures, one per code path (softmax router + plain experts, grouped sigmoid router
# + shared experts, biased transposed experts); every architecture runs the same function.
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_demo_hf_trains_both_and_reports_side_by_side(arch, tmp_path, rng, capsys):
    """python -m moegrad.demo --hf ARCH, a few tiny steps: both loss curves and both tokens/s in
    the table, the JSON and the plot; the same-state checks pass."""
    import json

    from moegrad import demo
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    rc = demo.main(["--hf", arch, "--data", str(text), "--steps", "3", "--batch", "2",
                    "--seq", "16", "--d-model", "32", "--d-expert", "16", "--quiet",
                    "--json", str(out_json), "--plot", str(out_png)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "moegrad.hf" in printed and "transformers grouped_mm" in printed
    assert "tokens / s" in printed
    r = json.loads(out_json.read_text())
    assert r["hf_arch"] == arch and r["passed"] and len(r["losses"]) == 3
    assert len(r["losses_reference"]) == 3
    assert r["tokens_per_s_moegrad"] > 0 and r["tokens_per_s_reference"] > 0
    assert all(c["status"] in ("ok", "tie") for c in r["same_state_checks"])
    assert r["patched"] and out_png.stat().st_size > 0


def test_demo_hf_rejects_unknown_arch(capsys):
    from moegrad import demo
    with pytest.raises(SystemExit):
        demo.main(["--hf", "llama"])
    assert "--hf must be one of" in capsys.readouterr().err


# --------------------------------------------------------------------- bench --hf (smoke) ---
def test_bench_hf_quick(tmp_path, capsys):
    """python -m moegrad.bench --hf --quick: runs, every backend timed, a markdown row per
    configuration, JSON records with the split and the peaks. No timing is asserted."""
    import json

    from moegrad.bench import main
    out = tmp_path / "b.json"
    rc = main(["--hf", "--quick", "--archs", "gpt_oss", "--dtypes", "fp32", "--no-compile",
               "--json", str(out)])
    assert rc == 0
    assert "| gpt_oss | float32 |" in capsys.readouterr().out
    r = json.loads(out.read_text())["records"][0]
    for k in ("moegrad_ms", "eager_ms", "grouped_mm_ms", "moegrad_non_gemm_ms",
              "grouped_mm_non_gemm_ms", "moegrad_peak_mb", "grouped_mm_peak_mb",
              "gemm_tflops_square", "eager_ceiling", "moegrad_gemm_tflops"):
        assert r[k] >= 0, k
    # every backend runs the same expert GEMMs (L229): T=64, K=2, H=64, I=32, gated; forward
    # and backward make three products per projection
    assert r["moegrad_gemm_gflop"] == pytest.approx(r["eager_gemm_gflop"], rel=1e-12)
    assert r["moegrad_gemm_gflop"] == pytest.approx(3 * 2 * 64 * 2 * 64 * (2 * 32 + 32) * 1e-9)
    assert any("router" in p for p in r["patched"])


def test_bench_hf_backends_share_weights_and_rounds_rotate():
    """The benchmark's per-backend copies compute on the original's weight tensors (no copy),
    and its rounds run every backend once per round in a rotated order (L218)."""
    from moegrad.bench import hf as bh
    from moegrad.bench.layer import _interleaved
    model = _build("qwen3_moe", layers=1)
    cp = bh._shared_copy(model)
    for (n, p), (_, q) in zip(model.named_parameters(), cp.named_parameters()):
        assert p is q, n
    assert cp.config is not model.config
    mh.apply(cp)
    assert model.config._experts_implementation == "eager"  # the original is left alone
    assert bh._find_block(cp) is not bh._find_block(model)

    calls = []
    fns = {n: (lambda n=n: calls.append(n)) for n in "abc"}
    med = _interleaved(fns, 3, lambda: None)
    assert set(med) == set("abc") and all(v >= 0 for v in med.values())
    assert calls == list("abc") + list("abc") + list("bca") + list("cab")


def test_bench_split_counts_a_grouped_gemm_whole():
    """The in-step split's GEMM time (L224) on one profiled step: torch's CPU grouped GEMM
    counts whole, with the per-expert slicing it does inside itself and without counting its
    own per-expert mm calls a second time; a GEMM with the router's operand shapes counts as
    non-GEMM."""
    from torch.profiler import ProfilerActivity, profile

    from moegrad.bench.layer import _GEMM_OPS, _gemm_seconds
    E, T, H = 32, 96, 16
    x, w = torch.randn(T, H), torch.randn(E, H, 8)
    offs = torch.arange(1, E + 1, dtype=torch.int32) * (T // E)
    try:
        torch._grouped_mm(x, w, offs=offs)
    except (AttributeError, RuntimeError, NotImplementedError) as e:
        pytest.skip(f"this torch has no CPU grouped GEMM ({type(e).__name__})")
    r = torch.randn(T, H)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        torch._grouped_mm(x, w, offs=offs)
        torch.mm(r, torch.randn(H, 4))  # router-shaped below
    ev = prof.events()
    grouped = [e for e in ev if e.name == "aten::_grouped_mm"]
    assert len(grouped) == 1
    router = {((T, H), (H, 4))}
    got = _gemm_seconds(ev, router)
    assert got == pytest.approx(grouped[0].cpu_time_total * 1e-6, rel=1e-9)
    assert _gemm_seconds(ev, set()) > got  # the router's mm, once it is not excepted
    inner = [e for e in ev if e.name in _GEMM_OPS and e.cpu_parent is not None]
    if inner:  # torch's CPU grouped GEMM as a mm per expert (torch 2.13: all E of them)
        # the self-time sum this replaces misses the slicing around those mm calls
        self_sum = sum(e.self_cpu_time_total for e in ev if e.name in _GEMM_OPS
                       and tuple(tuple(s) for s in e.input_shapes[:2]) not in router) * 1e-6
        assert self_sum < got


def test_bench_gemm_flops_count_every_product_once():
    """The FLOP count of the ceiling (L229): 2·m·k·n for mm, addmm (its bias skipped) and bmm,
    the per-expert mm inside torch's CPU grouped GEMM counted (the grouped op itself not), and
    a product with the router's operand shapes left out."""
    from torch.profiler import ProfilerActivity, profile

    from moegrad.bench.layer import _gemm_flops
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.mm(a, b)
        torch.addmm(torch.randn(3), a, b)
        torch.bmm(torch.randn(2, 5, 7), torch.randn(2, 7, 4))
        torch.mm(torch.randn(6, 7), torch.randn(7, 2))  # router-shaped below
    ev = prof.events()
    want = 2 * 5 * 7 * 3 * 2 + 2 * 2 * 5 * 7 * 4
    assert _gemm_flops(ev, {((6, 7), (7, 2))}) == want
    assert _gemm_flops(ev, set()) == want + 2 * 6 * 7 * 2
    E, T, H = 4, 12, 8
    x, w = torch.randn(T, H), torch.randn(E, H, 8)
    offs = torch.arange(1, E + 1, dtype=torch.int32) * (T // E)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        try:
            torch._grouped_mm(x, w, offs=offs)
        except (AttributeError, RuntimeError, NotImplementedError) as e:
            pytest.skip(f"this torch has no CPU grouped GEMM ({type(e).__name__})")
    if not any(e.name == "aten::mm" for e in prof.events()):
        pytest.skip("this torch's CPU grouped GEMM calls no mm inside itself")
    assert _gemm_flops(prof.events(), set()) == 2 * T * H * 8


def test_bench_timers_reset_each_step_outside_the_timing(monkeypatch):
    """A step's reset (freeing the weight gradients, L224) runs after every call of the step in
    every timer, warm-up included, after the clock has stopped and never inside a profiled
    region; a transformers block's step leaves its weight gradients set until its reset frees
    them."""
    import time as _time_mod

    from moegrad.bench import hf as bh
    from moegrad.bench.layer import _cpu_peak_bytes, _in_step_split, _interleaved, _time

    log = []
    real_clock = _time_mod.perf_counter

    def clock():
        log.append("t")
        return real_clock()

    monkeypatch.setattr(_time_mod, "perf_counter", clock)

    class Fake:
        def __init__(self, name, profiled=False):
            self.name, self.profiled = name, profiled

        def __call__(self):
            log.append("call " + self.name)
            assert torch.autograd._profiler_enabled() == self.profiled

        def reset(self):
            log.append("reset " + self.name)
            assert not torch.autograd._profiler_enabled()

    _time(Fake("a"), 3, lambda: None)
    assert log == ["call a", "reset a"] + ["t", "call a", "t", "reset a"] * 3
    log.clear()
    _in_step_split(Fake("a", profiled=True), 2, set())
    assert [e for e in log if e != "t"] == ["call a", "reset a"] * 2
    assert all(log[i - 1] == "t" for i, e in enumerate(log) if e == "reset a")
    log.clear()
    _cpu_peak_bytes(Fake("a", profiled=True))
    assert [e for e in log if e != "t"] == ["call a", "reset a"]
    log.clear()
    _interleaved({"a": Fake("a"), "b": Fake("b")}, 2, lambda: None)
    # warm-ups, then rounds in rotated order (a b, then b a), each timed call then its reset
    assert log == ["call a", "reset a", "call b", "reset b"] + [
        e for n in "abba" for e in ("t", "call " + n, "t", "reset " + n)]
    monkeypatch.undo()

    model = _build("qwen3_moe", layers=1)
    blk = bh._find_block(model)
    x = torch.randn(1, 8, model.config.hidden_size)
    step = bh._Step(blk, x, torch.randn_like(x))
    step()
    assert all(p.grad is not None for p in blk.parameters() if p.requires_grad)
    step.reset()
    assert all(p.grad is None for p in blk.parameters())


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_bench_hf_stub_gemms_replace_every_expert_gemm(arch):
    """--stub-gemms (L222): inside the context no expert GEMM runs in either backend (only the
    router's and shared experts' mm/addmm remain, none with the experts' stacked weights), the
    stub's gradients reach every expert weight in its own layout, and leaving the context
    restores torch's and moegrad's functions."""
    import torch.nn.functional as F

    from moegrad.bench import hf as bh
    import transformers.integrations.moe as tm
    before = (getattr(F, "grouped_mm", None), torch._grouped_mm, mh._TORCH_GROUPED_MM,
              mh.grouped_mm, tm._grouped_mm)
    model = _build(arch, layers=1)
    x = torch.randn(1, 8, model.config.hidden_size)
    for impl in ("grouped_mm", "moegrad"):
        m = bh._shared_copy(model)
        if impl == "moegrad":
            mh.apply(m)
        else:
            m.set_experts_implementation(impl)
        blk = bh._find_block(m)
        E = blk.experts.num_experts
        with bh._stubbed_expert_gemms(), torch.profiler.profile(record_shapes=True) as prof:
            y = _call(blk, x.clone().requires_grad_(True))
            y.backward(torch.randn_like(y))
        names = {e.name for e in prof.events()}
        assert bh.STUB_EVENT in names, impl
        assert not names & {"aten::_grouped_mm", "transformers::grouped_mm_fallback"}, impl
        assert not [e for e in prof.events() if e.name in ("aten::mm", "aten::addmm", "aten::bmm")
                    and any(len(s) == 3 and s[0] == E for s in e.input_shapes)], impl
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(blk.experts, name)
            assert p.grad is not None and p.grad.stride() == p.stride(), (impl, name)
    assert (getattr(F, "grouped_mm", None), torch._grouped_mm, mh._TORCH_GROUPED_MM,
            mh.grouped_mm, tm._grouped_mm) == before


def test_bench_hf_stub_gemms_quick(tmp_path, capsys):
    """python -m moegrad.bench --hf --stub-gemms --quick: both splits of both backends."""
    import json

    from moegrad.bench import main
    out = tmp_path / "s.json"
    assert main(["--hf", "--stub-gemms", "--quick", "--archs", "olmoe", "--dtypes", "bf16",
                 "--device", "cpu", "--json", str(out)]) == 0
    assert "| olmoe | bfloat16 |" in capsys.readouterr().out
    r = json.loads(out.read_text())["records"][0]
    for k in ("moegrad_non_gemm_ms", "grouped_mm_non_gemm_ms", "moegrad_own_non_gemm_ms",
              "grouped_mm_own_non_gemm_ms"):
        assert r[k] > 0, k
