"""Routing replay (moe_gating_replay, docs/operators.md §2.8, D34), top-k without
renormalisation (no_renorm, D33) and aligned expert blocks (align_block, §8.13, D36): against the
float64 reference, torch.autograd of the forward formula, and the unpadded layout."""

import numpy as np
import pytest
import torch

import moegrad
import reference as ref
from conftest import assert_close_to_ref, dtype_params, randn


def _ref_weights(x, idx, norm_type, renorm, no_renorm, rsf, eps):
    """§2.4 steps 1, 5-7 at given ids in float64; D33: no renormalisation with no_renorm."""
    norm = ref.normalize(ref.as_f64(x), norm_type)
    ids = ref.as_i64(idx)
    if no_renorm:
        y = np.take_along_axis(norm, ids, 1) * ref.f32(rsf)
    else:
        y = ref.gating_weights(norm, ids, renorm, norm_type, rsf, eps)
    return y, norm


def _distinct_ids(M, N, K, rng, dtype=torch.int64):
    """[M, K] ids, distinct within each row (a valid selection)."""
    rows = [rng.permutation(N)[:K] for _ in range(M)]
    return torch.from_numpy(np.array(rows, dtype=np.int64).reshape(M, K)).to(dtype)


def _torch_weights(x, idx, norm_type, renorm, no_renorm, rsf, eps):
    """The forward formula in plain torch (float64), for torch.autograd."""
    x = x.double()
    if norm_type == 0:
        s = torch.softmax(x, -1)
    elif norm_type == 1:
        s = torch.sigmoid(x)
    else:
        s = torch.sqrt(torch.nn.functional.softplus(x))
    g = s.gather(1, idx.long())
    if not no_renorm and (norm_type != 0 or renorm == 1):
        g = g / (g.sum(1, keepdim=True) + eps)
    return g * rsf, s


CASES = [(0, 0, False), (0, 1, False), (0, 1, True), (1, 0, False), (1, 0, True), (2, 0, False),
         (2, 0, True)]
CASE_IDS = ["softmax", "softmax_renorm", "softmax_no_renorm", "sigmoid", "sigmoid_no_renorm",
            "sqrtsoftplus", "sqrtsoftplus_no_renorm"]


@dtype_params
@pytest.mark.parametrize("norm_type,renorm,no_renorm", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("M,N,K", [(33, 16, 4), (7, 2, 2), (5, 9, 1), (4, 6, 6), (0, 8, 2),
                                   (3, 257, 7)])
def test_replay_matches_reference(dtype, norm_type, renorm, no_renorm, M, N, K, rng):
    x = randn((M, N), dtype, rng, std=2.0)
    idx = _distinct_ids(M, N, K, rng, torch.int32)
    rsf, eps = 1.75, 1e-20
    y, norm = moegrad.moe_gating_replay(x, idx, renorm=renorm, norm_type=norm_type,
                                        routed_scaling_factor=rsf, eps=eps, no_renorm=no_renorm)
    y_ref, norm_ref = _ref_weights(x, idx, norm_type, renorm, no_renorm, rsf, eps)
    n_red = (N if norm_type == 0 else 1) + K
    assert y.dtype == dtype and norm.dtype == torch.float32
    assert_close_to_ref(norm, norm_ref, torch.float32, n_reduce=n_red, what="norm_out")
    renormed = not no_renorm and (norm_type != 0 or renorm == 1)
    g = np.take_along_axis(norm_ref, ref.as_i64(idx), 1)
    scale = rsf * g * (2.0 / np.maximum(g.sum(1, keepdims=True), 1e-30) if renormed else 1.0)
    assert_close_to_ref(y, y_ref, dtype, scale=scale, n_reduce=n_red, what="y")


@pytest.mark.parametrize("norm_type,renorm,no_renorm", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_of_forward_ids_is_bitwise_the_forward(norm_type, renorm, no_renorm, dtype, rng):
    x = randn((64, 32), dtype, rng, std=2.0)
    bias = randn((32,), dtype, rng, std=0.2)
    kw = dict(renorm=renorm, norm_type=norm_type, routed_scaling_factor=2.5, no_renorm=no_renorm)
    y, idx, norm = moegrad.moe_gating_top_k(x, 6, bias=bias, out_flag=True, **kw)
    y2, norm2 = moegrad.moe_gating_replay(x, idx, bias=bias, **kw)
    assert torch.equal(y, y2) and torch.equal(norm, norm2)
    y3, _ = moegrad.moe_gating_replay(x, idx.long(), **kw)  # the bias plays no part
    assert torch.equal(y, y3)


@pytest.mark.parametrize("norm_type,renorm,no_renorm", CASES, ids=CASE_IDS)
def test_replay_autograd_matches_torch_formula(norm_type, renorm, no_renorm, rng):
    M, N, K = 12, 10, 3
    x = randn((M, N), torch.float32, rng, std=2.0).requires_grad_()
    idx = _distinct_ids(M, N, K, rng)
    gy = randn((M, K), torch.float32, rng)
    gn = randn((M, N), torch.float32, rng)
    y, norm = moegrad.moe_gating_replay(x, idx, renorm=renorm, norm_type=norm_type,
                                        routed_scaling_factor=1.5, no_renorm=no_renorm)
    ((y * gy).sum() + (norm * gn).sum()).backward()
    x64 = x.detach().double().requires_grad_()
    y64, s64 = _torch_weights(x64, idx, norm_type, renorm, no_renorm, 1.5, 1e-20)
    ((y64 * gy.double()).sum() + (s64 * gn.double()).sum()).backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=2e-5, atol=2e-6)


def test_replay_opcheck_and_compile(rng):
    x = randn((9, 8), torch.float32, rng).requires_grad_()
    idx = _distinct_ids(9, 8, 2, rng, torch.int32)
    torch.library.opcheck(torch.ops.moegrad.moe_gating_replay, (x, idx, None, 0, 1, 1.0, 1e-20,
                                                                 True))
    f = torch.compile(lambda a, b: moegrad.moe_gating_replay(a, b, norm_type=1)[0].sum(),
                      fullgraph=True)
    assert torch.allclose(f(x, idx), moegrad.moe_gating_replay(x, idx, norm_type=1)[0].sum())


@pytest.mark.parametrize("ids,words", [
    ([[0, 1], [2, 8], [4, 5]], ["expert_idx", "8"]),
    ([[0, 1], [-1, 3], [4, 5]], ["expert_idx", "-1"]),
    ([[0, 1], [2, 3], [6, 6]], ["expert_idx", "6", "row 2"]),
])
def test_replay_rejects_bad_host_ids(ids, words):
    with pytest.raises(moegrad.MoeError) as e:
        moegrad.moe_gating_replay(torch.zeros(3, 8), torch.tensor(ids, dtype=torch.int32))
    assert e.value.code == 161002
    for w in words:
        assert w in str(e.value), str(e.value)


def test_replay_rejects_bad_shapes():
    with pytest.raises(moegrad.MoeError) as e:
        moegrad.moe_gating_replay(torch.zeros(3, 8), torch.zeros(4, 2, dtype=torch.int32))
    assert e.value.code == 561002 and "expert_idx" in str(e.value)
    with pytest.raises(moegrad.MoeError) as e:
        moegrad.moe_gating_replay(torch.zeros(3, 2), torch.zeros(3, 3, dtype=torch.int32))
    assert e.value.code == 561002 and "expert_idx" in str(e.value)


# ------------------------------------------------------------------ D33 in the gating pair --
@pytest.mark.parametrize("norm_type", [0, 1, 2], ids=["softmax", "sigmoid", "sqrtsoftplus"])
@dtype_params
def test_gating_no_renorm_forward_and_autograd(norm_type, dtype, rng):
    M, N, K = 24, 16, 4
    x = randn((M, N), dtype, rng, std=2.0).requires_grad_()
    y, idx, _ = moegrad.moe_gating_top_k(x, K, renorm=1, norm_type=norm_type,
                                         routed_scaling_factor=1.25, no_renorm=True)
    y_ref, norm = _ref_weights(x.detach(), idx, norm_type, 1, True, 1.25, 1e-20)
    g = np.take_along_axis(norm, ref.as_i64(idx), 1)
    assert_close_to_ref(y, y_ref, dtype, scale=1.25 * g, n_reduce=N, what="y")
    gy = randn((M, K), dtype, rng)
    (y.float() * gy.float()).sum().backward()
    x64 = x.detach().double().requires_grad_()
    y64, _ = _torch_weights(x64, idx, norm_type, 1, True, 1.25, 1e-20)
    (y64 * gy.double()).sum().backward()
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=tol, atol=tol * 0.1)


@pytest.mark.parametrize("norm_type", [0, 1, 2])
def test_gating_backward_no_renorm_k1_gives_router_gradient(norm_type, rng):
    # K = 1 with renormalisation: every weight is 1 and the gradient 0 (sigmoid); without it the
    # router learns (D33).
    x = randn((8, 4), torch.float32, rng).requires_grad_()
    y, _, _ = moegrad.moe_gating_top_k(x, 1, norm_type=norm_type, no_renorm=True)
    (y * randn((8, 1), torch.float32, rng)).sum().backward()
    assert x.grad.abs().sum() > 0
    if norm_type == 1:
        x.grad = None
        y, _, _ = moegrad.moe_gating_top_k(x, 1, norm_type=1)
        assert torch.all(y == 1.0)
        (y * randn((8, 1), torch.float32, rng)).sum().backward()
        assert torch.all(x.grad == 0)


# ------------------------------------------------------------------------ D36 aligned blocks --
def _layer(x, ids, scales, w_up, w_down, E, align):
    """init routing -> a per-expert MLP over each expert's block (a grouped GEMM) -> finalize."""
    if align:
        ex, idx, counts, offsets = moegrad.moe_init_routing(x, ids, expert_num=E,
                                                            align_block=align)
        bounds = offsets.tolist()
    else:
        ex, idx, counts = moegrad.moe_init_routing(x, ids, expert_num=E)
        bounds = [0] + torch.cumsum(counts, 0).tolist()
    outs = []
    for e in range(E):
        blk = ex[bounds[e]:bounds[e + 1]]
        outs.append(torch.nn.functional.silu(blk @ w_up[e]) @ w_down[e])
    rows = torch.cat(outs + [ex.new_zeros((ex.shape[0] - bounds[E], ex.shape[1]))])
    y = moegrad.moe_finalize_routing(rows, idx, scales=scales, drop_pad_mode=2,
                                     padded=bool(align))
    return y, counts, (offsets if align else None), ex, idx


@pytest.mark.parametrize("align", [16, 32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_aligned_layout_gives_same_layer_output_and_gradients(align, dtype, rng):
    R, K, E, H, F = 45, 2, 6, 8, 5
    ids = _distinct_ids(R, E, K, rng, torch.int32)
    base = [randn((R, H), dtype, rng), randn((R, K), dtype, rng).abs(),
            randn((E, H, F), dtype, rng), randn((E, F, H), dtype, rng)]
    gy = randn((R, H), dtype, rng)
    results = []
    for a in (0, align):
        leaves = [t.clone().requires_grad_() for t in base]
        y, counts, offsets, ex, idx = _layer(leaves[0], ids, leaves[1], leaves[2], leaves[3], E,
                                             a)
        (y.float() * gy.float()).sum().backward()
        results.append((y, [t.grad for t in leaves], counts, offsets, ex, idx))
    (y0, g0, c0, _, _, _), (y1, g1, c1, off, ex, idx) = results
    assert torch.equal(c0, c1), "counts stay the real counts"
    assert off.dtype == torch.int64 and off.shape == (E + 1,)
    assert torch.all(off % align == 0)
    assert torch.equal(off[1:] - off[:-1], (c1 + align - 1) // align * align)
    assert ex.shape[0] == R * K + E * (align - 1)
    used = torch.zeros(ex.shape[0], dtype=torch.bool)
    used[idx.long()] = True
    assert torch.all(ex[~used] == 0), "padding rows are zero"
    # The GEMMs over padded blocks may sum in another order (BLAS blocking): a rounding apart.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y1, y0, rtol=tol, atol=tol)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_aligned_init_routing_opcheck_and_errors(rng):
    x = randn((5, 4), torch.float32, rng)
    ids = _distinct_ids(5, 4, 2, rng, torch.int32)
    torch.library.opcheck(torch.ops.moegrad.moe_init_routing,
                          (x, ids, 0, 0, 4, 0, 1, True, None, 0, 16))
    out = moegrad.moe_init_routing(x, ids, expert_num=4)
    assert len(out) == 3
    with pytest.raises(moegrad.MoeError) as e:
        moegrad.moe_init_routing(x, ids, expert_num=4, align_block=16, active_num=3)
    assert e.value.code == 561103 and "active_num" in str(e.value)
    with pytest.raises(moegrad.MoeError) as e:
        moegrad.moe_init_routing(x, ids, align_block=16)
    assert "expert_num" in str(e.value)
    with pytest.raises(moegrad.MoeError) as e:
        moegrad.moe_init_routing(x, ids, expert_num=4, align_block=-2)
    assert "align_block" in str(e.value)
    ex, idx, _, _ = moegrad.moe_init_routing(x, ids, expert_num=4, align_block=16)
    with pytest.raises(moegrad.MoeError) as e:  # the padded layout needs padded=True
        moegrad.moe_finalize_routing(ex, idx, drop_pad_mode=2, k=2)
    assert "expanded_x" in str(e.value)
