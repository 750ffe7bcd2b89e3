"""moegrad.nn.MoE as a GPT-OSS MoE block (docs/layer.md "GPT-OSS experts"): the router (linear
with bias, top-k of the logits, softmax over the k), experts with biases on both projections and
the clipped, interleaved SwiGLU, against a plain-torch float64 GPT-OSS block written here
(transformers' GptOssTopKRouter / GptOssExperts formulas); forward and every gradient."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moegrad.nn import MoE

GPT_OSS = dict(score="softmax", activation="clipped_swiglu", expert_bias=True, router_bias=True)


def gpt_oss_block(x, router_w, router_b, gate_up, gate_up_b, down, down_b, K, alpha=1.702,
                  limit=7.0):
    """x [T, H]; router_w [E, H], router_b [E]; gate_up [E, H, 2F] (gate and up interleaved in
    the columns), gate_up_b [E, 2F]; down [E, F, H], down_b [E, H]."""
    logits = F.linear(x, router_w, router_b)
    top_v, top_i = torch.topk(logits, K, dim=-1)
    w = torch.softmax(top_v, dim=1)
    out = torch.zeros_like(x)
    for e in range(router_w.shape[0]):
        tok, slot = (top_i == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = x[tok] @ gate_up[e] + gate_up_b[e]
        gate, up = gu[..., ::2], gu[..., 1::2]
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
        glu = gate * torch.sigmoid(gate * alpha)
        o = ((up + 1) * glu) @ down[e] + down_b[e]
        out = out.index_add(0, tok, o * w[tok, slot].unsqueeze(-1))
    return out, top_i


def make_layer(H, F_, E, K, seed, **extra):
    torch.manual_seed(seed)
    m = MoE(H, F_, E, K, **{**GPT_OSS, **extra})
    with torch.no_grad():  # biases start at zero: make them matter
        m.b_up.normal_(0.0, 0.5)
        m.b_down.normal_(0.0, 0.5)
        m.gate_bias.normal_(0.0, 0.5)
        m.gate.normal_(0.0, 0.5)
        m.w_up.mul_(4.0)   # pre-activations beyond the limit, so the clamps act
    return m


@pytest.mark.parametrize("limit", [7.0, 1.5], ids=["limit7", "limit1.5"])
def test_gpt_oss_block_forward_and_gradients_match_float64(limit, seed):
    H, F_, E, K = 16, 12, 6, 2
    m = make_layer(H, F_, E, K, seed, swiglu_limit=limit)
    x = torch.randn(3, 5, H, requires_grad=True)
    y = m(x)
    up = torch.randn_like(y)  # random upstream gradient
    (y * up).sum().backward()

    p = {n: t.detach().double().clone().requires_grad_(True) for n, t in m.named_parameters()}
    xr = x.detach().double().reshape(-1, H).requires_grad_(True)
    yr, idx_r = gpt_oss_block(xr, p["gate"], p["gate_bias"], p["w_up"], p["b_up"], p["w_down"],
                              p["b_down"], K, limit=limit)
    (yr * up.double().reshape(-1, H)).sum().backward()

    assert torch.equal(m.last_expert_idx.long().sort(-1).values, idx_r.sort(-1).values)
    pre = (xr.detach() @ p["w_up"].detach()[0]).abs()
    assert float(pre.max()) > limit, "the test must reach the clamp"
    # Elementwise rtol 1e-4, and an atol of 1e-6 of the tensor's largest element (about 16 fp32
    # roundings of it): an element that is a near-cancelling sum of terms at that scale keeps
    # their rounding. A fixed atol of 1e-5 failed seed 4140969799 (x.grad up to 45; one element
    # of 1.8e-3 off by 1.3e-5, 2.9e-7 of the scale); a dropped term is off by O(scale).
    for got, ref in ((y.double().reshape(-1, H), yr.detach()),
                     (x.grad.double().reshape(-1, H), xr.grad)):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6 * float(ref.abs().max()))
    for n, t in m.named_parameters():
        assert t.grad is not None, n
        scale = float(p[n].grad.abs().max()) + 1e-12
        err = float((t.grad.double() - p[n].grad).abs().max())
        assert err <= 1e-4 * scale + 1e-6, f"{n}: max err {err:.3e} vs scale {scale:.3e}"
    assert set(p) == {"gate", "gate_bias", "w_up", "b_up", "w_down", "b_down"}


def test_swiglu_activation_with_biases_and_capacity(seed):
    """expert_bias with the plain SwiGLU and in capacity mode: same output as dropless when no
    token is dropped (capacity large enough), gradients for both biases."""
    H, F_, E, K = 8, 6, 4, 2
    kw = dict(score="softmax", activation="swiglu", expert_bias=True, router_bias=True)
    torch.manual_seed(seed)
    a = MoE(H, F_, E, K, **kw)
    b = MoE(H, F_, E, K, capacity_factor=float(E), **kw)
    with torch.no_grad():
        a.b_up.normal_()
        a.b_down.normal_()
    b.load_state_dict(a.state_dict())
    x = torch.randn(10, H)
    ya, yb = a(x), b(x)
    torch.testing.assert_close(ya, yb, rtol=1e-5, atol=1e-5)
    ya.square().sum().backward()
    yb.square().sum().backward()
    for n in ("b_up", "b_down", "gate_bias"):
        torch.testing.assert_close(getattr(a, n).grad, getattr(b, n).grad, rtol=1e-4, atol=1e-5)


def test_arguments():
    with pytest.raises(ValueError, match="MoE: activation: must be"):
        MoE(8, 4, 4, 2, activation="gelu")
    with pytest.raises(ValueError, match="MoE: swiglu_limit: must be > 0; got 0"):
        MoE(8, 4, 4, 2, activation="clipped_swiglu", swiglu_limit=0.0)
    with pytest.raises(ValueError, match="MoE: swiglu_alpha: must be finite"):
        MoE(8, 4, 4, 2, swiglu_alpha=float("nan"))
    with pytest.raises(TypeError, match="MoE: swiglu_offset: must be a number"):
        MoE(8, 4, 4, 2, swiglu_offset="1")
    m = MoE(8, 4, 4, 2)
    assert m.b_up is None and m.b_down is None and m.gate_bias is None
    assert {n for n, _ in m.named_parameters()} == {"gate", "w_up", "w_down"}
