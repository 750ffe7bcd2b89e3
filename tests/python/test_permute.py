"""moegrad.moe_permute / moe_unpermute, and the raw composition of the operators they pair
(docs/layer.md "Permute and unpermute", docs/decisions.md L170, L171).

* The pair is exact: expanded_x against the stable sort rule, y against a float64 sum over the
  expert outputs, dropless and with a capacity, fp32/fp16/bf16, edge sizes.
* Gradients of x, scales, residual and an expert parameter equal torch.autograd of the formula.
* torch.compile(fullgraph=True) traces both calls into one graph and matches eager.
* The obvious raw composition is exact or refused: moe_init_routing's index with
  moe_finalize_routing's default drop_pad_mode=0 raises MoeError (R > 1 and K > 1), mode 2 is
  exact, and a column-layout index built by hand is still accepted in mode 0.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import moegrad
from moegrad import MoeError, PermuteState, moe_permute, moe_unpermute
from conftest import (DTYPE_IDS, DTYPES, assert_close_to_ref, rand_expert_idx, randn, to_np,
                      uniform)

# (R, K, E): no tokens, one token, K = 1, K = E, several tokens per expert, odd sizes.
SIZES = [(0, 2, 4), (1, 3, 4), (7, 1, 3), (16, 2, 8), (13, 4, 4), (9, 3, 5)]


def _rows_of_slots(idx, E, C):
    """float64-free reference of the layout: expanded row of each slot r*K + k (-1: dropped)."""
    flat = idx.reshape(-1).astype(np.int64)
    order = sorted(range(flat.size), key=lambda s: (flat[s], s))   # stable sort by expert
    rows = np.full(flat.size, -1, np.int64)
    seen = np.zeros(E, np.int64)
    for d, s in enumerate(order):
        e = flat[s]
        if C == 0:
            rows[s] = d
        elif seen[e] < C:
            rows[s] = e * C + seen[e]
        seen[e] += 1
    return rows


def _case(R, K, E, H, dtype, rng):
    x = randn((R, H), dtype, rng)
    idx = rand_expert_idx(R, K, E, rng)
    scales = uniform((R, K), torch.float32, rng, 0.1, 1.0)
    residual = randn((R, H), dtype, rng)
    return x, idx, scales, residual


@pytest.mark.parametrize("capacity", [0, 2], ids=["dropless", "capacity2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("R,K,E", SIZES)
def test_pair_matches_the_float64_reference(R, K, E, dtype, capacity, rng):
    H = 5
    x, idx, scales, residual = _case(R, K, E, H, dtype, rng)
    expanded_x, state = moe_permute(x, idx, E, capacity=capacity)
    rows = _rows_of_slots(to_np(idx), E, capacity)
    lead = (E, capacity) if capacity else (R * K,)
    assert tuple(expanded_x.shape) == (*lead, H)
    assert isinstance(state, PermuteState)
    assert (state.num_tokens, state.top_k, state.num_experts, state.capacity) == (R, K, E,
                                                                                  capacity)
    assert state.drop_pad_mode == (3 if capacity else 2)
    np.testing.assert_array_equal(state.expanded_row_idx.numpy(), rows)
    np.testing.assert_array_equal(state.tokens_per_expert.numpy(),
                                  np.bincount(to_np(idx).reshape(-1).astype(np.int64),
                                              minlength=E))
    # Data movement is exact: each kept slot's row is its token's row; unused rows are zero.
    flat_x = expanded_x.reshape(-1, H)
    used = np.zeros(flat_x.shape[0], bool)
    for s, d in enumerate(rows):
        if d >= 0:
            assert torch.equal(flat_x[d], x[s // K]), (s, d)
            used[d] = True
    assert not flat_x[torch.from_numpy(~used)].any()

    # Each expert output row differs (a per-row function), so a wrong row shows.
    expert_out = randn(tuple(expanded_x.shape), dtype, rng)
    y = moe_unpermute(expert_out, state, scales, residual=residual)
    eo = to_np(expert_out).reshape(-1, H)
    s64, r64 = to_np(scales), to_np(residual)
    expected, scale = r64.copy(), np.abs(r64)
    for r in range(R):
        for k in range(K):
            d = rows[r * K + k]
            if d >= 0:
                expected[r] += s64[r, k] * eo[d]
                scale[r] += np.abs(s64[r, k] * eo[d])
    assert y.dtype == dtype and tuple(y.shape) == (R, H)
    assert_close_to_ref(y, expected, scale=scale, n_reduce=K + 1, what="moe_unpermute")


@pytest.mark.parametrize("capacity", [0, 3], ids=["dropless", "capacity3"])
def test_pair_gradients_match_autograd_of_the_formula(capacity, rng):
    R, K, E, H = 11, 2, 4, 6
    x, idx, scales, residual = _case(R, K, E, H, torch.float32, rng)
    a = uniform((E, H), torch.float32, rng, 0.5, 1.5)        # an expert parameter
    leaves = [t.clone().requires_grad_() for t in (x, scales, residual, a)]
    up = randn((R, H), torch.float32, rng)                     # random upstream gradient

    xm, sm, rm, am = leaves
    expanded_x, state = moe_permute(xm, idx, E, capacity=capacity)
    if capacity:
        expert_out = expanded_x * am[:, None, :]
    else:
        experts = torch.repeat_interleave(torch.arange(E), state.tokens_per_expert)
        expert_out = expanded_x * am[experts]
    (moe_unpermute(expert_out, state, sm, residual=rm) * up).sum().backward()

    rows = _rows_of_slots(to_np(idx), E, capacity)
    kept = torch.from_numpy(rows >= 0).reshape(R, K).float()
    ref = [t.clone().requires_grad_() for t in (x, scales, residual, a)]
    xr, sr, rr, ar = ref
    terms = xr[:, None, :] * ar[idx.long()] * (sr * kept)[:, :, None]   # [R, K, H]
    ((rr + terms.sum(1)) * up).sum().backward()
    for name, got, want in zip(("x", "scales", "residual", "expert parameter"), leaves, ref):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_pair_compiles_into_one_graph_and_matches_eager(rng):
    R, K, E, H = 12, 2, 4, 8
    x, _, _, residual = _case(R, K, E, H, torch.float32, rng)
    logits = randn((R, E), torch.float32, rng)
    w = uniform((E, H), torch.float32, rng, 0.5, 1.5)

    def layer(x, logits, w, residual):
        weights, idx, _ = moegrad.moe_gating_top_k(logits, K, norm_type=1)
        expanded_x, state = moe_permute(x, idx, E)
        experts = torch.repeat_interleave(torch.arange(E), state.tokens_per_expert,
                                          output_size=R * K)
        return moe_unpermute(expanded_x * w[experts], state, weights, residual=residual)

    explanation = torch._dynamo.explain(layer)(x, logits, w, residual)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    ye = layer(xe, logits, w, residual)
    yc = torch.compile(layer, fullgraph=True, backend="aot_eager")(xc, logits, w, residual)
    torch.testing.assert_close(yc, ye, rtol=0, atol=0)
    up = randn((R, H), torch.float32, rng)
    (ye * up).sum().backward()
    (yc * up).sum().backward()
    torch.testing.assert_close(xc.grad, xe.grad, rtol=0, atol=0)


@pytest.mark.parametrize("needs_grad", [False, True], ids=["plain", "autograd"])
def test_init_then_finalize_with_the_default_mode_is_refused(needs_grad, rng):
    R, K, E, H = 6, 2, 4, 5
    x, idx, scales, _ = _case(R, K, E, H, torch.float32, rng)
    x.requires_grad_(needs_grad)
    expanded_x, row_idx, _ = moegrad.moe_init_routing(x, idx, expert_num=E)
    with pytest.raises(MoeError, match=r"^moe_finalize_routing: drop_pad_mode: must be 2 "
                                       r".*row layout.*; got 0$") as info:
        moegrad.moe_finalize_routing(expanded_x, row_idx, scales=scales, k=K)
    assert info.value.code == 561103
    with pytest.raises(MoeError, match="drop_pad_mode: .*; got 0$"):
        moegrad.moe_finalize_routing(expanded_x, row_idx, k=K)          # R from the index
    # The matching mode is exact: each token gets sum_k scales[r, k] * x[r].
    y = moegrad.moe_finalize_routing(expanded_x, row_idx, scales=scales, drop_pad_mode=2, k=K)
    expected = to_np(x) * to_np(scales).sum(1, keepdims=True)
    assert_close_to_ref(y.detach(), expected, n_reduce=K, what="mode 2")


def test_default_mode_still_takes_what_it_can_read(rng):
    """No false refusals: K = 1 and R = 1, where both layouts coincide, and a column-layout
    index built by hand (the vendor's first routing), all in mode 0."""
    for R, K in ((5, 1), (1, 3)):
        x, idx, _, _ = _case(R, K, 4, 3, torch.float32, rng)
        expanded_x, row_idx, _ = moegrad.moe_init_routing(x, idx, expert_num=4)
        y = moegrad.moe_finalize_routing(expanded_x, row_idx, k=K)
        assert_close_to_ref(y, to_np(x) * K, n_reduce=K, what=f"R={R}, K={K}")
    R, K, E, H = 6, 2, 4, 5
    x, idx, scales, _ = _case(R, K, E, H, torch.float32, rng)
    column = idx.t().reshape(-1).long()                    # slot k*R + r
    order = torch.argsort(column, stable=True)
    col_idx = torch.empty_like(order)
    col_idx[order] = torch.arange(order.numel())
    y = moegrad.moe_finalize_routing(x[order % R], col_idx.int(), scales=scales, k=K)
    expected = to_np(x) * to_np(scales).sum(1, keepdims=True)
    assert_close_to_ref(y, expected, n_reduce=K, what="column layout, mode 0")


def test_unpermute_refuses_what_permute_did_not_make(rng):
    R, K, E, H = 6, 2, 4, 5
    x, idx, scales, residual = _case(R, K, E, H, torch.float32, rng)
    expanded_x, state = moe_permute(x, idx, E)
    with pytest.raises(MoeError, match=r"^moe_unpermute: state: must be the PermuteState "
                                       r"returned by moe_permute; got tuple$"):
        moe_unpermute(expanded_x, tuple(state), scales)
    with pytest.raises(MoeError, match=r"^moe_unpermute: expert_out: must be \[12, H\] .*; got "
                                       r"shape \[11, 5\]$") as info:
        moe_unpermute(expanded_x[:-1], state, scales)
    assert info.value.code == 561103
    with pytest.raises(MoeError, match=r"^moe_unpermute: residual: must be \[R, H\] = \[6, 5\]; "
                                       r"got shape \[5, 5\]$"):
        moe_unpermute(expanded_x, state, scales, residual=residual[:-1])
    _, cap_state = moe_permute(x, idx, E, capacity=2)
    with pytest.raises(MoeError, match=r"expert_out: must be \[4, 2, H\]"):
        moe_unpermute(expanded_x, cap_state, scales)       # a dropless result, capacity state
    for bad, match in ((0, r"num_experts: must be >= 1; got 0$"),
                       (2.0, r"num_experts: must be an int; got 2.0$")):
        with pytest.raises(MoeError, match=r"^moe_permute: " + match):
            moe_permute(x, idx, bad)
    with pytest.raises(MoeError, match=r"^moe_permute: capacity: must be >= 0; got -1$"):
        moe_permute(x, idx, E, capacity=-1)
    with pytest.raises(MoeError, match=r"^moe_permute: expert_idx: must be 2-D \[R, K\]; got "
                                       r"shape \[12\]$"):
        moe_permute(x, idx.reshape(-1), E)
    with pytest.raises(AttributeError):
        state.top_k = 1                                    # the state is immutable
