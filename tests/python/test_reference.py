"""Validate the float64 reference (reference.py) against the worked examples of operators.md
(§1.9, §3.9 with and without bias, §4.7, §5.8) and a few properties stated in docs/operators.md.
Runs without the library."""

import numpy as np
import pytest

import reference as ref


def _close(actual, listed, decimals, what):
    """`listed` is printed with `decimals` decimals: the exact value is within half a unit."""
    actual = np.asarray(actual, dtype=np.float64)
    listed = np.asarray(listed, dtype=np.float64)
    tol = 0.5 * 10.0 ** -decimals + 1e-12
    err = np.abs(actual - listed)
    assert np.all(err <= tol), f"{what}: got {actual}, listed {listed} (max err {err.max():.3g})"


# --- §1.9 gating backward --------------------------------------------------------------------
EX19_XNORM = np.array([[0.5, 0.7, 0.3, 0.8, 0.2, 0.6, 0.9, 0.4],
                       [0.6, 0.4, 0.8, 0.1, 0.7, 0.5, 0.3, 0.9],
                       [0.2, 0.9, 0.5, 0.6, 0.8, 0.3, 0.7, 0.4],
                       [0.8, 0.3, 0.6, 0.5, 0.4, 0.7, 0.2, 0.9]], dtype=np.float32)
EX19_GRADY = np.array([[1.0, 0.5], [0.8, 0.3], [0.6, 0.9], [0.4, 0.7]], dtype=np.float32)
EX19_IDX = np.array([[3, 6], [2, 7], [1, 4], [0, 7]], dtype=np.int32)
EX19_EXPECTED = {(0, 3): 0.062284, (0, 6): -0.031142, (1, 2): 0.062284, (1, 7): -0.031142,
                 (2, 1): -0.018685, (2, 4): 0.037370, (3, 0): -0.037370, (3, 7): 0.018685}


def test_reference_gating_backward_matches_spec_example_1_9():
    gx = ref.moe_gating_top_k_backward(EX19_XNORM, EX19_GRADY, EX19_IDX, renorm=0, norm_type=1,
                                       routed_scaling_factor=2.5, eps=1e-20)
    expected = np.zeros((4, 8))
    for (i, j), v in EX19_EXPECTED.items():
        expected[i, j] = v
    _close(gx, expected, 6, "§1.9 gradX")
    assert np.all(gx[expected == 0] == 0.0), "non-selected experts must get exactly 0"


def test_reference_gating_backward_is_derivative_of_sigmoid_renorm_forward():
    # §1.5: exact derivative of y = rsf * s_p / (sum_q s_q + eps), s = sigmoid(x).
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 6))
    idx = np.array([[0, 4, 2], [5, 1, 3], [2, 3, 0]])
    gy = rng.standard_normal((3, 3))
    rsf, eps = 1.7, 1e-3

    def loss(xx):
        y = ref.gating_weights(ref.sigmoid(xx), idx, 0, 1, rsf, eps)
        return np.sum(y * gy)

    num = np.zeros_like(x)
    h = 1e-6
    for i in range(3):
        for j in range(6):
            xp, xm = x.copy(), x.copy()
            xp[i, j] += h
            xm[i, j] -= h
            num[i, j] = (loss(xp) - loss(xm)) / (2 * h)
    gx = ref.moe_gating_top_k_backward(ref.sigmoid(x), gy, idx, routed_scaling_factor=rsf,
                                       eps=eps)
    # eps/rsf are fp32-rounded inside the reference (attribute type), hence the 1e-6 slack
    np.testing.assert_allclose(gx, num, rtol=1e-5, atol=1e-6)


def test_reference_gating_backward_scatter_adds_repeated_ids():
    xn = np.array([[0.3, 0.6, 0.8]])
    gx = ref.moe_gating_top_k_backward(xn, np.array([[1.0, 2.0]]), np.array([[2, 2]]))
    # w' = [0.8, 0.8], D = 1.6, w = [.5,.5], beta = 1.5, g' = [-0.3125, 0.3125] -> sum 0
    np.testing.assert_allclose(gx, [[0.0, 0.0, 0.0]], atol=1e-15)
    gx = ref.moe_gating_top_k_backward(xn, np.array([[1.0, 2.0, 4.0]]), np.array([[2, 2, 0]]))
    D = 1.9
    beta = (0.8 * 1 + 0.8 * 2 + 0.3 * 4) / D
    g = [(1 - beta) / D, (2 - beta) / D, (4 - beta) / D]
    np.testing.assert_allclose(gx, [[0.3 * 0.7 * g[2], 0, 0.8 * 0.2 * (g[0] + g[1])]],
                               rtol=1e-6)


# --- §3.9 finalize routing grad ---------------------------------------------------------------
EX39 = dict(
    grad_y=np.array([[0.3816, 0.3939], [0.8474, 0.1652]], dtype=np.float32),
    expanded_row_idx=np.array([1, 3, 0, 2], dtype=np.int32),
    expanded_x=np.array([[0.6049, 0.3315], [0.4954, 0.3284], [0.7060, 0.4359],
                         [0.6514, 0.9476]], dtype=np.float32),
    scales=np.array([[0.4708, 0.0656], [0.9652, 0.9512]], dtype=np.float32),
    expert_idx=np.array([[0, 1], [0, 1]], dtype=np.int32),
    bias=np.array([[0.6452, 0.1981], [0.4159, 0.9575]], dtype=np.float32),
)
EX39_GRAD_EX = [[0.817910, 0.159451], [0.179657, 0.185448], [0.806047, 0.157138],
                [0.025033, 0.025840]]
EX39_GRAD_SCALES_BIAS = [[0.642641, 1.157701], [1.146825, 1.180888]]
EX39_GRAD_SCALES_NOBIAS = [[0.318401, 0.621834], [0.567356, 0.670275]]


def test_reference_finalize_grad_matches_spec_example_3_9_with_bias():
    gex, gsc = ref.moe_finalize_routing_grad(drop_pad_mode=0, **EX39)
    _close(gex, EX39_GRAD_EX, 6, "§3.9 gradExpandedX")
    _close(gsc, EX39_GRAD_SCALES_BIAS, 6, "§3.9 gradScales (bias)")


def test_reference_finalize_grad_matches_spec_example_3_9_without_bias():
    kw = {k: v for k, v in EX39.items() if k not in ("bias", "expert_idx")}
    gex, gsc = ref.moe_finalize_routing_grad(drop_pad_mode=0, **kw)
    _close(gex, EX39_GRAD_EX, 6, "§3.9 gradExpandedX (no bias)")
    _close(gsc, EX39_GRAD_SCALES_NOBIAS, 6, "§3.9 gradScales (no bias)")


def test_reference_finalize_grad_droppad_and_active_num_rules():
    gy = np.array([[1.0, 2.0], [3.0, 4.0]])
    ex = np.arange(2 * 2 * 2, dtype=np.float64).reshape(2, 2, 2)  # E=2, C=2
    sc = np.array([[0.5, 2.0], [1.0, 3.0]])
    eid = np.array([[1, 0], [0, 1]])
    b = np.array([[10.0, 20.0], [30.0, 40.0]])
    idx = np.array([3, -1, 0, -1])  # row layout: (r0,k0)->3, (r0,k1) dropped, (r1,k0)->0
    gex, gsc = ref.moe_finalize_routing_grad(gy, idx, ex, sc, eid, b, drop_pad_mode=1,
                                             expert_num=2, expert_capacity=2)
    exp_gex = np.zeros((2, 2, 2))
    exp_gex[1, 1] = [0.5, 1.0]
    exp_gex[0, 0] = [3.0, 4.0]
    np.testing.assert_array_equal(gex, exp_gex)
    exp_gsc = [[(6 + 30) * 1 + (7 + 40) * 2, 10 * 1 + 20 * 2],      # valid / dropped: bias only
               [(0 + 10) * 3 + (1 + 20) * 4, 30 * 3 + 40 * 4]]
    np.testing.assert_array_equal(gsc, exp_gsc)
    # active_num truncation (mode 0): index >= active_num skipped, gradScales bias-only
    ex0 = np.arange(6, dtype=np.float64).reshape(3, 2)
    gex, gsc = ref.moe_finalize_routing_grad(gy, np.array([2, 3, 0, 1]), ex0, sc, eid, b,
                                             drop_pad_mode=0, active_num=3)
    assert gex.shape == (3, 2)
    np.testing.assert_array_equal(gex, [[3.0, 4.0], [9.0, 12.0], [0.5, 1.0]])
    np.testing.assert_array_equal(gsc[0, 1], 10 * 1 + 20 * 2)
    # no scales (D5): K = 1, grad_scales (R, 1) zeros, expanded rows = grad_y
    gex, gsc = ref.moe_finalize_routing_grad(gy, np.array([1, 0]))
    np.testing.assert_array_equal(gex, gy[::-1])
    np.testing.assert_array_equal(gsc, np.zeros((2, 1)))


# --- §4.7 finalize routing forward ------------------------------------------------------------
EX47_EX = np.array([[0.1, 1.1, 2.1, 3.1], [4.1, 5.1, 6.1, 7.1], [8.1, 9.1, 10.1, 11.1],
                    [0.1, 1.1, 2.1, 3.1], [4.1, 5.1, 6.1, 7.1], [8.1, 9.1, 10.1, 11.1]],
                   dtype=np.float32)
EX47_X1 = np.array([[0.2, 1.2, 2.2, 3.2], [4.2, 5.2, 6.2, 7.2], [8.2, 9.2, 10.2, 11.2]],
                   dtype=np.float32)
EX47_BIAS = np.array([[0.2, 0.4, 0.2, 0.4], [0.2, 0.4, 0.2, 0.4]], dtype=np.float32)
EX47_SCALES = np.array([[1.3, 1.6], [1.2, 1.8], [1.2, 2.3]], dtype=np.float32)
EX47_EID = np.array([[0, 1], [0, 1], [0, 1]], dtype=np.int32)
EX47_IDX = np.array([2, 1, 4, 3, 0, 5], dtype=np.int32)
EX47_OUT = [[11.67, 17.15, 21.47, 26.95], [14.10, 19.70, 24.10, 29.70],
            [40.65, 46.85, 51.65, 57.85]]


def test_reference_finalize_forward_matches_spec_example_4_7():
    out = ref.moe_finalize_routing(EX47_EX, EX47_IDX, EX47_X1, EX47_X1, EX47_BIAS, EX47_SCALES,
                                   EX47_EID, drop_pad_mode=0)
    _close(out, EX47_OUT, 2, "§4.7 out")


def test_reference_finalize_forward_layouts_and_dropped_slots():
    ex = np.array([[1.0], [10.0], [100.0], [1000.0]])
    sc = np.array([[1.0, 2.0], [3.0, 4.0]])
    idx = np.array([0, 1, 2, 3])
    # column layout: (r, k) -> idx[k*R + r]: r0 -> 0, 2 ; r1 -> 1, 3
    np.testing.assert_array_equal(ref.moe_finalize_routing(ex, idx, scales=sc, drop_pad_mode=0),
                                  [[1 + 200.0], [30 + 4000.0]])
    # row layout: (r, k) -> idx[r*K + k]: r0 -> 0, 1 ; r1 -> 2, 3
    np.testing.assert_array_equal(ref.moe_finalize_routing(ex, idx, scales=sc, drop_pad_mode=2),
                                  [[1 + 20.0], [300 + 4000.0]])
    # dropped slot keeps scale * bias (D7), dropless index >= rows likewise (L5)
    b = np.array([[5.0], [7.0]])
    eid = np.array([[0, 1], [1, 0]])
    out = ref.moe_finalize_routing(ex.reshape(2, 2, 1), np.array([-1, 1, 3, -1]), None, None, b,
                                   sc, eid, drop_pad_mode=3)
    np.testing.assert_array_equal(out, [[1 * 5.0 + 2 * (10 + 7)], [3 * (1000 + 7) + 4 * 5.0]])
    out = ref.moe_finalize_routing(ex[:2], np.array([0, 3, 2, 1]), None, None, b, sc, eid,
                                   drop_pad_mode=2)
    np.testing.assert_array_equal(out, [[1 * 6.0 + 2 * 7.0], [3 * 7.0 + 4 * 15.0]])
    # no scales/expert_idx: K = numel / R (L4)
    out = ref.moe_finalize_routing(ex, idx, drop_pad_mode=0, R=2)
    np.testing.assert_array_equal(out, [[101.0], [1010.0]])


# --- §5.8 SwiGLU backward ---------------------------------------------------------------------
def example_5_8_inputs():
    """The §5.8 inputs, built as docs/operators.md §5.8 describes (values converted to fp16; weight fp32)."""
    i = np.arange(512 * 512)
    grad_y = ((i % 10) * 0.1).astype(np.float32).astype(np.float16).reshape(512, 512)
    j = np.arange(512 * 1024)
    x = (((j % 20) - 10) * 0.5).astype(np.float32).astype(np.float16).reshape(512, 1024)
    weight = (((np.arange(512) % 5) + 1) * 0.2).astype(np.float32)
    y_origin = (((i % 8) + 1) * 0.3).astype(np.float32).astype(np.float16).reshape(512, 512)
    group_index = (np.arange(256) * 2).astype(np.int64)
    return grad_y, x, weight, y_origin, group_index


EX58_GX0 = [-0.0, -0.00076, -0.00211, -0.00422, -0.00705, -0.00994, -0.01089, -0.00578,
            -0.01157, -0.04681]
EX58_GX1 = [-0.00705, -0.01193, -0.01452, -0.00826, -0.01736, -0.07281, -0.15991, -0.26636, 0, 0]
EX58_GW = [312.599, 314.939, 316.079, 316.019, 314.758]
EX58_SUM_GX, EX58_SUM_ABS_GX, EX58_SUM_GW = -799.30, 13847.14, 161215.70


def test_reference_swiglu_backward_matches_spec_example_5_8():
    gy, x, w, yo, gi = example_5_8_inputs()
    gx, gw = ref.swiglu_group_quant_backward(gy, x, w, yo, gi, clamp_limit=1.0)
    gx16 = gx.astype(np.float16).astype(np.float64)  # the example rounds gradX to fp16
    _close(gx16[0, :10], EX58_GX0, 5, "§5.8 gradX[0,0:10]")
    _close(gx16[1, :10], EX58_GX1, 5, "§5.8 gradX[1,0:10]")
    assert np.all(gx16[0, 512:522] == 0), "§5.8 gradX[0,512:522] must be masked to 0"
    _close(gw[:5], EX58_GW, 3, "§5.8 gradWeight[0:5]")
    np.testing.assert_allclose(gw[:510].reshape(-1, 5), np.tile(gw[:5], (102, 1)), rtol=1e-12)
    _close(gx16.sum(), EX58_SUM_GX, 2, "§5.8 sum gradX")
    _close(np.abs(gx16).sum(), EX58_SUM_ABS_GX, 2, "§5.8 sum |gradX|")
    _close(gw.sum(), EX58_SUM_GW, 2, "§5.8 sum gradWeight")


# --- gating forward properties (no numeric worked example in §2.7) ---------------------------
def test_reference_gating_forward_ties_go_to_lower_index_and_nan_ranks_first():
    x = np.array([[1.0, 3.0, 3.0, 2.0, 3.0],
                  [0.0, np.nan, 5.0, np.nan, 1.0]])
    _, idx, _ = ref.moe_gating_top_k(x, 3, norm_type=1)
    np.testing.assert_array_equal(idx, [[1, 2, 4], [1, 3, 2]])


def test_reference_gating_forward_bias_only_for_selection_and_renorm_rules():
    x = np.array([[0.0, 1.0, 2.0, 3.0]])
    bias = np.array([10.0, 0.0, 0.0, 0.0])
    y, idx, norm = ref.moe_gating_top_k(x, 2, bias=bias, norm_type=1, out_flag=True,
                                        routed_scaling_factor=2.0, eps=0.0)
    s = 1 / (1 + np.exp(-x[0]))
    np.testing.assert_array_equal(idx, [[0, 3]])
    np.testing.assert_allclose(y, [[2 * s[0] / (s[0] + s[3]), 2 * s[3] / (s[0] + s[3])]])
    np.testing.assert_allclose(norm, [s])
    # softmax without renorm: raw probabilities times rsf, no eps
    y, idx, norm = ref.moe_gating_top_k(x, 2, norm_type=0, renorm=0,
                                        routed_scaling_factor=-1.5)
    p = np.exp(x[0]) / np.exp(x[0]).sum()
    np.testing.assert_allclose(y, [[-1.5 * p[3], -1.5 * p[2]]])
    np.testing.assert_array_equal(norm, np.zeros((1, 4)))  # out_flag False -> zeros (L1)
    # softmax with renorm
    y, _, _ = ref.moe_gating_top_k(x, 2, norm_type=0, renorm=1, eps=0.0)
    np.testing.assert_allclose(y, [[p[3] / (p[3] + p[2]), p[2] / (p[3] + p[2])]])
    # sqrt-softplus always renormalises
    y, _, _ = ref.moe_gating_top_k(x, 2, norm_type=2, eps=0.0)
    q = np.sqrt(np.log1p(np.exp(x[0])))
    np.testing.assert_allclose(y, [[q[3] / (q[3] + q[2]), q[2] / (q[3] + q[2])]])


def test_reference_gating_forward_group_limited_both_modes():
    # 4 groups of 2, sigmoid scores s. max per group: s(1), s(5), s(4), s(4.5) -> groups 1, 3;
    # top-2 sums: 1.442, 1.493, 1.964, 1.514 -> groups 2, 3
    x = np.array([[1.0, 0.9, 5.0, 0.0, 4.0, 4.0, 4.5, 0.1]])
    _, idx0, _ = ref.moe_gating_top_k(x, 3, k_group=2, group_count=4, group_select_mode=0,
                                      norm_type=1)
    np.testing.assert_array_equal(idx0, [[2, 6, 7]])
    _, idx1, _ = ref.moe_gating_top_k(x, 3, k_group=2, group_count=4, group_select_mode=1,
                                      norm_type=1)
    np.testing.assert_array_equal(idx1, [[6, 4, 5]])
    # group tie: equal group scores -> lower group index kept
    x = np.array([[3.0, 0.0, 3.0, 1.0, 3.0, 2.0]])
    _, idx, _ = ref.moe_gating_top_k(x, 2, k_group=1, group_count=3, norm_type=0)
    np.testing.assert_array_equal(idx, [[0, 1]])


def test_reference_stable_sigmoid_limits():
    s = ref.sigmoid(np.array([-1000.0, -100.0, 0.0, 100.0, 1000.0, np.nan]))
    assert s[0] == 0.0 and s[-2] == 1.0 and s[3] == 1.0 and s[2] == 0.5
    assert 0 < s[1] < 1e-40 and np.isnan(s[-1])


def test_reference_swiglu_forward_and_clamp_mask():
    x = np.array([[-1.0, 2.0, 3.0, 1.5, -1.5, 0.5]])  # H = 3; clamp 1.5
    y = ref.swiglu_group(x, clamp_limit=1.5)
    x0c = np.array([-1.0, 1.5, 1.5])
    x1c = np.array([1.5, -1.5, 0.5])
    np.testing.assert_allclose(y, [x0c / (1 + np.exp(-x0c)) * x1c])
    gx, gw = ref.swiglu_group_quant_backward(np.ones((1, 3)), x, clamp_limit=1.5)
    assert gw is None
    assert gx[0, 1] == 0 and gx[0, 2] == 0       # x0 >= c masked (x0 = 2 and 3)
    assert gx[0, 3] == 0 and gx[0, 4] == 0       # x1 = +-c exactly: masked (strict)
    assert gx[0, 0] != 0 and gx[0, 5] != 0
    # truncation (L8): negative entries count, sum clamped to [0, T]
    assert ref.swiglu_trunc(5, np.array([3, -1])) == 2
    assert ref.swiglu_trunc(5, np.array([-3])) == 0
    assert ref.swiglu_trunc(5, np.array([4, 4])) == 5
    assert ref.swiglu_trunc(5, np.zeros(0, np.int64)) == 0


@pytest.mark.parametrize("norm_type", [0, 1, 2])
def test_reference_ambiguity_detector_flags_near_ties_only(norm_type):
    x = np.array([[0.5, 0.5 + 1e-9, -1.0, 2.0], [0.5, 0.6, -1.0, 2.0], [1.0, 1.0, 0.0, 2.0]])
    amb = ref.gating_ambiguous_rows(x, 2, norm_type=norm_type)
    # row 0: near tie at the k/k+1 boundary; row 1: clear; row 2: exact tie (index rule)
    np.testing.assert_array_equal(amb, [True, False, False])
