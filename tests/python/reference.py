"""Independent float64 reference implementations of the six moegrad operators.

Written from docs/operators.md (sections named below), the contract decisions D1-D21 and the
local decisions L1-L11 (both in docs/decisions.md) only -- never
from the library's code.

Conventions
-----------
* Inputs may be numpy arrays or torch tensors (any dtype). Floating inputs are converted to
  float64 *after* whatever rounding the tensor already carries, so pass the tensor that was given
  to the library (fp16/bf16-rounded), not the value it was drawn from.
* All arithmetic is float64. Attributes that the operators take as fp32 (routed_scaling_factor,
  eps, clamp_limit; §1.4, §2.2, §5.6 "exact fp32 compare") are first rounded to fp32.
* Outputs are float64 numpy arrays; indices are int64 numpy arrays.
* Nothing here narrows to fp16/bf16: the tests compare with a per-dtype tolerance instead.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "as_f64", "as_i64", "f32", "sigmoid", "softplus", "softmax", "normalize", "order_desc",
    "moe_gating_top_k", "gating_weights", "gating_scores", "gating_ambiguous_rows",
    "moe_gating_top_k_backward", "gating_backward_magnitude",
    "moe_finalize_routing", "moe_finalize_routing_grad",
    "swiglu_group", "swiglu_group_quant_backward", "swiglu_backward_magnitude", "swiglu_trunc",
    "moe_init_routing", "moe_init_routing_grad",
    "clipped_swiglu", "clipped_swiglu_grad",
]


# --------------------------------------------------------------------------------------------
# conversions
# --------------------------------------------------------------------------------------------
def _is_torch(a):
    return type(a).__module__.startswith("torch") and hasattr(a, "detach")


def as_f64(a):
    """Tensor/array -> float64 numpy array (None stays None)."""
    if a is None:
        return None
    if _is_torch(a):
        import torch

        t = a.detach().cpu()
        return t.to(torch.float64).numpy().copy()
    return np.array(a, dtype=np.float64)


def as_i64(a):
    """Index tensor/array -> int64 numpy array (None stays None)."""
    if a is None:
        return None
    if _is_torch(a):
        import torch

        return a.detach().cpu().to(torch.int64).numpy().copy()
    return np.array(a, dtype=np.int64)


def f32(v):
    """A double attribute as the kernels see it (rounded to fp32), returned as a Python float."""
    return float(np.float32(v))


# --------------------------------------------------------------------------------------------
# scalar functions (float64, stable)
# --------------------------------------------------------------------------------------------
def sigmoid(x):
    """Stable logistic function: no overflow, exact 0/1 limits, NaN propagates (D12, L11)."""
    x = np.asarray(x, dtype=np.float64)
    out = np.empty_like(x)
    pos = x >= 0
    with np.errstate(over="ignore", invalid="ignore"):
        out[pos] = 1.0 / (1.0 + np.exp(-x[pos]))
        e = np.exp(x[~pos])  # NaN lands here and stays NaN
        out[~pos] = e / (1.0 + e)
    return out


def softplus(x):
    """log(1 + exp(x)) computed without overflow."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.maximum(x, 0.0) + np.log1p(np.exp(-np.abs(x)))


def softmax(x):
    """Row softmax (max-subtracted). A NaN anywhere in a row makes the whole row NaN."""
    x = np.asarray(x, dtype=np.float64)
    if x.shape[0] == 0:
        return x.copy()
    with np.errstate(invalid="ignore", over="ignore"):
        m = np.max(x, axis=-1, keepdims=True)
        e = np.exp(x - m)
        return e / np.sum(e, axis=-1, keepdims=True)


def normalize(x, norm_type):
    """§2.4 step 1: 0 softmax, 1 sigmoid, 2 sqrt(softplus)."""
    if norm_type == 0:
        return softmax(x)
    if norm_type == 1:
        return sigmoid(x)
    if norm_type == 2:
        return np.sqrt(softplus(x))
    raise ValueError(f"norm_type {norm_type}")


def order_desc(s):
    """Indices that sort the last axis by the strict total order of L2 / §2.4 step 4:
    NaN above every number, then larger value first, equal values -> lower index first."""
    s = np.asarray(s, dtype=np.float64)
    isn = np.isnan(s)
    v = np.where(isn, 0.0, s)
    pos = np.broadcast_to(np.arange(s.shape[-1]), s.shape)
    # np.lexsort: the LAST key is the primary one, all ascending.
    return np.lexsort((pos, -v, ~isn), axis=-1)


# --------------------------------------------------------------------------------------------
# §2 MoeGatingTopK forward
# --------------------------------------------------------------------------------------------
def gating_scores(x, bias=None, k_group=1, group_count=1, group_select_mode=0, norm_type=0):
    """Selection scores of §2.4 steps 1-3.

    Returns dict(norm, score, masked, gscore, gmag, keep, mag):
      norm   normalised scores (no bias),      score  norm + bias (ranking only),
      masked score with -inf outside the kept groups (== score without grouping),
      gscore group scores (None without grouping), keep kept-group mask,
      mag    |norm| + |bias| (magnitude of each score, used for the near-tie test),
      gmag   magnitude of each group score.
    """
    x = as_f64(x)
    M, N = x.shape
    norm = normalize(x, norm_type)
    b = as_f64(bias)
    if b is not None:
        score = norm + b.reshape(1, N)
        mag = np.abs(norm) + np.abs(b).reshape(1, N)
    else:
        score = norm.copy()
        mag = np.abs(norm)
    res = dict(norm=norm, score=score, masked=score, gscore=None, gmag=None, keep=None, mag=mag)
    if group_count > 1:
        ng = N // group_count
        gs = score.reshape(M, group_count, ng)
        gm = mag.reshape(M, group_count, ng)
        o = order_desc(gs)  # within-group order, NaN first (L2)
        top = np.take_along_axis(gs, o, -1)
        topm = np.take_along_axis(gm, o, -1)
        if group_select_mode == 0:
            gscore, gmag = top[..., 0], topm[..., 0]
        elif group_select_mode == 1:
            gscore, gmag = top[..., 0] + top[..., 1], topm[..., 0] + topm[..., 1]
        else:
            raise ValueError(f"group_select_mode {group_select_mode}")
        gorder = order_desc(gscore)  # same rule for groups (L2): ties -> lower group
        keep = np.zeros((M, group_count), dtype=bool)
        np.put_along_axis(keep, gorder[:, :k_group], True, axis=-1)
        masked = np.where(np.repeat(keep, ng, axis=1), score, -np.inf)
        res.update(masked=masked, gscore=gscore, gmag=gmag, keep=keep)
    return res


def gating_weights(norm, idx, renorm=0, norm_type=0, routed_scaling_factor=1.0, eps=1e-20):
    """§2.4 steps 5-7 for given indices: gather the unbiased scores, renormalise, scale."""
    norm = as_f64(norm)
    idx = as_i64(idx)
    g = np.take_along_axis(norm, idx, axis=1)
    if norm_type in (1, 2) or renorm == 1:
        with np.errstate(invalid="ignore", divide="ignore"):
            g = g / (np.sum(g, axis=1, keepdims=True) + f32(eps))
    return g * f32(routed_scaling_factor)


def moe_gating_top_k(x, k, bias=None, k_group=1, group_count=1, group_select_mode=0, renorm=0,
                     norm_type=0, out_flag=False, routed_scaling_factor=1.0, eps=1e-20):
    """§2.4 (TopK mode) with D13 and L1/L2. Returns (y [M,k] f64, expert_idx [M,k] i64,
    norm_out [M,N] f64; zeros when out_flag is False per L1)."""
    sc = gating_scores(x, bias, k_group, group_count, group_select_mode, norm_type)
    idx = order_desc(sc["masked"])[:, :k].astype(np.int64)
    y = gating_weights(sc["norm"], idx, renorm, norm_type, routed_scaling_factor, eps)
    norm_out = sc["norm"].copy() if out_flag else np.zeros_like(sc["norm"])
    return y, idx, norm_out


def _near(a, b, ma, mb, rel):
    """True where a and b differ but by less than rel * magnitude (an fp32 near-tie).
    Exact equality (incl. NaN == NaN, -inf == -inf) is a real tie decided by the index rule."""
    an, bn = np.isnan(a), np.isnan(b)
    with np.errstate(invalid="ignore"):
        diff = np.abs(a - b)
        tol = rel * np.maximum(ma, mb)
        near = (diff > 0) & (diff <= tol)
    return near & ~an & ~bn & np.isfinite(a) & np.isfinite(b)


def gating_ambiguous_rows(x, k, bias=None, k_group=1, group_count=1, group_select_mode=0,
                          norm_type=0, rel=2e-6):
    """Rows whose top-k result could legitimately differ between this float64 reference and an
    fp32 kernel: two different scores closer than `rel` times their magnitude at a place where
    their order matters (adjacent among the first k+1 selected, or the kept/dropped group
    boundary). Returns a boolean array [M]."""
    sc = gating_scores(x, bias, k_group, group_count, group_select_mode, norm_type)
    M, N = sc["score"].shape
    amb = np.zeros(M, dtype=bool)
    if M == 0:
        return amb
    if sc["gscore"] is not None and k_group < group_count:
        go = order_desc(sc["gscore"])
        gs = np.take_along_axis(sc["gscore"], go, 1)
        gm = np.take_along_axis(sc["gmag"], go, 1)
        amb |= _near(gs[:, k_group - 1], gs[:, k_group], gm[:, k_group - 1], gm[:, k_group], rel)
    o = order_desc(sc["masked"])
    s = np.take_along_axis(sc["masked"], o, 1)
    m = np.take_along_axis(sc["mag"], o, 1)
    last = min(k + 1, N)
    for p in range(last - 1):
        amb |= _near(s[:, p], s[:, p + 1], m[:, p], m[:, p + 1], rel)
    return amb


# --------------------------------------------------------------------------------------------
# §1 MoeGatingTopKBackward
# --------------------------------------------------------------------------------------------
def moe_gating_top_k_backward(x_norm, grad_y, expert_idx, renorm=0, norm_type=1,
                              routed_scaling_factor=1.0, eps=1e-20):
    """§1.5, scatter-add for repeated ids (D1). Returns grad_x [M,N] f64."""
    xn = as_f64(x_norm)
    gy = as_f64(grad_y)
    e = as_i64(expert_idx)
    M, N = xn.shape
    gs = f32(routed_scaling_factor) * gy
    wp = np.take_along_axis(xn, e, axis=1)
    D = f32(eps) + np.sum(wp, axis=1, keepdims=True)
    w = wp / D
    beta = np.sum(w * gs, axis=1, keepdims=True)
    gp = (gs - beta) / D
    G = np.zeros((M, N))
    rows = np.repeat(np.arange(M), e.shape[1])
    np.add.at(G, (rows, e.reshape(-1)), gp.reshape(-1))
    return xn * (1.0 - xn) * G


def gating_backward_magnitude(x_norm, grad_y, expert_idx, routed_scaling_factor=1.0, eps=1e-20):
    """Same formula with every term replaced by its absolute value: the scale against which
    fp32 rounding/cancellation error of §1.5 is measured."""
    xn = as_f64(x_norm)
    gy = as_f64(grad_y)
    e = as_i64(expert_idx)
    M, N = xn.shape
    gs = np.abs(f32(routed_scaling_factor) * gy)
    wp = np.take_along_axis(xn, e, axis=1)
    D = np.abs(f32(eps) + np.sum(wp, axis=1, keepdims=True))
    w = np.abs(wp) / D
    beta = np.sum(w * gs, axis=1, keepdims=True)
    gp = (gs + beta) / D
    G = np.zeros((M, N))
    rows = np.repeat(np.arange(M), e.shape[1])
    np.add.at(G, (rows, e.reshape(-1)), gp.reshape(-1))
    return np.abs(xn * (1.0 - xn)) * G


# --------------------------------------------------------------------------------------------
# §4 MoeFinalizeRouting (V2) forward
# --------------------------------------------------------------------------------------------
def moe_finalize_routing(expanded_x, expanded_row_idx, x1=None, x2=None, bias=None, scales=None,
                         expert_idx=None, drop_pad_mode=0, R=None, K=None):
    """§4.5 with D7 (dropped slot adds scale*bias), D8 (layouts), L4 (K), L5 (dropless index >=
    rows of expanded_x behaves like a dropped slot). Returns out [R,H] f64.

    R defaults to the row count of scales / expert_idx / x1, K per L4."""
    ex = as_f64(expanded_x)
    H = ex.shape[-1]
    ex2 = ex.reshape(-1, H)
    rows = ex2.shape[0]
    idx = as_i64(expanded_row_idx).reshape(-1)
    s = as_f64(scales)
    eid = as_i64(expert_idx)
    b = as_f64(bias)
    a1, a2 = as_f64(x1), as_f64(x2)
    if R is None:
        for t in (s, eid, a1):
            if t is not None:
                R = t.shape[0]
                break
    if K is None:
        if s is not None:
            K = s.shape[1]
        elif eid is not None:
            K = eid.shape[1]
        else:
            K = idx.size // R
    if R is None:
        R = idx.size // K
    assert idx.size == R * K, (idx.size, R, K)
    out = np.zeros((R, H))
    if a1 is not None:
        out += a1
    if a2 is not None:
        out += a2
    r = np.arange(R)
    for k in range(K):
        flat = k * R + r if drop_pad_mode in (0, 1) else r * K + k
        d = idx[flat]
        valid = (d >= 0) & (d < rows)
        term = np.zeros((R, H))
        term[valid] = ex2[d[valid]]
        if b is not None:
            term = term + b[eid[:, k]]
        sk = s[:, k:k + 1] if s is not None else 1.0
        out += sk * term
    return out


def finalize_routing_magnitude(expanded_x, expanded_row_idx, x1=None, x2=None, bias=None,
                               scales=None, expert_idx=None, drop_pad_mode=0, R=None, K=None):
    """|x1| + |x2| + sum |s| (|ex| + |bias|): the scale of the fp32 accumulation error."""
    ab = lambda t: None if t is None else np.abs(as_f64(t))  # noqa: E731
    return moe_finalize_routing(ab(expanded_x), expanded_row_idx, ab(x1), ab(x2), ab(bias),
                                ab(scales), expert_idx, drop_pad_mode, R, K)


# --------------------------------------------------------------------------------------------
# §3 MoeFinalizeRoutingV2Grad
# --------------------------------------------------------------------------------------------
def moe_finalize_routing_grad(grad_y, expanded_row_idx, expanded_x=None, scales=None,
                              expert_idx=None, bias=None, drop_pad_mode=0, active_num=0,
                              expert_num=0, expert_capacity=0, _abs=False):
    """§3.5 (row layout flat = r*K + k), §3.7, D4, D5, D7, L6.

    Returns (grad_expanded_x f64 [(dim0|E), (H|C), (-|H)], grad_scales f64 [R, K] or [R, 1]).
    With _abs=True every factor is replaced by its absolute value (error scale)."""
    ab = (lambda t: None if t is None else np.abs(t)) if _abs else (lambda t: t)  # noqa: E731
    gy = ab(as_f64(grad_y))
    R, H = gy.shape
    idx = as_i64(expanded_row_idx).reshape(-1)
    s = ab(as_f64(scales))
    K = s.shape[1] if s is not None else 1
    n = R * K
    assert idx.size == n, (idx.size, R, K)
    if drop_pad_mode == 0:
        rows = active_num if 0 < active_num < n else n
        shape = (rows, H)
    else:
        rows = expert_num * expert_capacity
        shape = (expert_num, expert_capacity, H)
    gex = np.zeros((rows, H))
    r = np.arange(n) // K
    k = np.arange(n) % K
    valid = (idx >= 0) & (idx < rows)
    sv = s[r, k] if s is not None else np.ones(n)
    gex[idx[valid]] = gy[r[valid]] * sv[valid][:, None]
    if s is None:
        gsc = np.zeros((R, 1))  # D5
    else:
        ex2 = ab(as_f64(expanded_x)).reshape(-1, H)
        acc = np.zeros(n)
        acc[valid] = np.sum(ex2[idx[valid]] * gy[r[valid]], axis=1)
        if bias is not None:
            b = ab(as_f64(bias))
            eid = as_i64(expert_idx).reshape(-1)
            acc += np.sum(b[eid] * gy[r], axis=1)
        gsc = acc.reshape(R, K)
    return gex.reshape(shape), gsc


# --------------------------------------------------------------------------------------------
# §5 SwigluGroupQuantGrad and the SwiGLU forward (§6.4 without quantisation, L8, L9, D9, D10)
# --------------------------------------------------------------------------------------------
def swiglu_trunc(T, group_index):
    """L8, L52: trunc = clamp(sum(group_index), 0, T), the sum exact; T without group_index."""
    if group_index is None:
        return T
    gi = as_i64(group_index).reshape(-1)
    total = sum(int(v) for v in gi)  # exact: numpy's int64 sum would wrap around (L52)
    return int(min(max(total, 0), T))


def _split(x):
    x = as_f64(x)
    lead = x.shape[:-1]
    T = int(np.prod(lead)) if len(lead) else 1
    H = x.shape[-1] // 2
    xt = x.reshape(T, 2 * H)
    return lead, T, H, xt[:, :H], xt[:, H:]


def _clamp(x0, x1, clamp_limit):
    c = f32(clamp_limit)
    if c > 0:
        return c, np.minimum(x0, c), np.clip(x1, -c, c)
    return c, x0, x1


def swiglu_group(x, weight=None, group_index=None, clamp_limit=-1.0):
    """y = silu(x0') * x1' * weight[t] for t < trunc, 0 for the other rows. Returns [..., H]."""
    lead, T, H, x0, x1 = _split(x)
    _, x0c, x1c = _clamp(x0, x1, clamp_limit)
    with np.errstate(invalid="ignore", over="ignore"):
        y = x0c * sigmoid(x0c) * x1c
        if weight is not None:
            y = y * as_f64(weight).reshape(T, 1)
    y[swiglu_trunc(T, group_index):] = 0.0
    return y.reshape(*lead, H)


def swiglu_group_quant_backward(grad_y, x, weight=None, y_origin=None, group_index=None,
                                clamp_limit=-1.0):
    """§5.5 steps 0-8. Returns (grad_x f64 like x, grad_weight f64 like weight or None)."""
    lead, T, H, x0, x1 = _split(x)
    gy = as_f64(grad_y).reshape(T, H)
    c, x0c, x1c = _clamp(x0, x1, clamp_limit)
    w = as_f64(weight).reshape(T, 1) if weight is not None else None
    with np.errstate(invalid="ignore", over="ignore"):
        gy0 = gy * w if w is not None else gy
        sig = sigmoid(x0c)
        silu = x0c * sig
        dsilu = sig * (1.0 + x0c * (1.0 - sig))
        gx0 = gy0 * x1c * dsilu
        gx1 = gy0 * silu
    if c > 0:  # strict inequalities on the unclamped inputs (step 6, D11)
        gx0 = np.where(x0 < c, gx0, 0.0)
        gx1 = np.where((x1 > -c) & (x1 < c), gx1, 0.0)
    trunc = swiglu_trunc(T, group_index)
    gx = np.concatenate([gx0, gx1], axis=1)
    gx[trunc:] = 0.0
    gw = None
    if weight is not None:
        gwt = np.sum(gy * as_f64(y_origin).reshape(T, H), axis=1)
        gwt[trunc:] = 0.0
        gw = gwt.reshape(as_f64(weight).shape)
    return gx.reshape(*lead, 2 * H), gw


def swiglu_backward_magnitude(grad_y, x, weight=None, y_origin=None, group_index=None,
                              clamp_limit=-1.0):
    """Error scale of §5.5: |gy0 * x1'| * sigma * (1 + |x0'| (1 - sigma)) for the x0 half,
    |gy0 * silu| for the x1 half, sum |gy * y_origin| for grad_weight."""
    lead, T, H, x0, x1 = _split(x)
    gy = np.abs(as_f64(grad_y).reshape(T, H))
    _, x0c, x1c = _clamp(x0, x1, clamp_limit)
    with np.errstate(invalid="ignore", over="ignore"):
        gy0 = gy * np.abs(as_f64(weight).reshape(T, 1)) if weight is not None else gy
        sig = sigmoid(x0c)
        m0 = gy0 * np.abs(x1c) * sig * (1.0 + np.abs(x0c) * (1.0 - sig))
        m1 = gy0 * np.abs(x0c * sig)
    gx = np.concatenate([m0, m1], axis=1).reshape(*lead, 2 * H)
    gw = None
    if weight is not None:
        gw = np.sum(gy * np.abs(as_f64(y_origin).reshape(T, H)), axis=1)
        gw = gw.reshape(as_f64(weight).shape)
    return gx, gw


# --------------------------------------------------------------------------------------------
# Token permutation: moe_init_routing / moe_init_routing_grad (docs/operators.md §8, D25-D31)
# Written from the formulas of §8.5, §8.8, §8.9 with numpy's stable argsort as the sort rule.
# --------------------------------------------------------------------------------------------
def moe_init_routing(x, expert_idx, active_num=0, expert_capacity=0, expert_num=0,
                     drop_pad_mode=0, expert_tokens_num_type=1, expert_tokens_num_flag=True,
                     active_expert_range=None, row_idx_type=0):
    """Returns (expanded_x float64, expanded_row_idx int64, counts int64 or an empty array)."""
    xv = as_f64(x)
    e = as_i64(expert_idx)
    R, H = xv.shape
    K = e.shape[1]
    flat = e.reshape(-1)
    N = R * K
    E = expert_num
    if active_expert_range:
        lo, hi = active_expert_range
    else:
        lo, hi = 0, (E if E > 0 else (int(flat.max()) + 1 if N else 0))
    inside = (flat >= lo) & (flat < hi)
    # key: in-window ids sort first by id; then ids >= hi by id; ids < lo last (slot order).
    big = np.int64(1) << 40
    key = np.where(inside, flat, np.where(flat >= hi, big + flat, 2 * big))
    S = np.argsort(key, kind="stable")
    n_act = int(inside.sum())
    flag = expert_tokens_num_flag and (E > 0 or bool(active_expert_range))
    counts_e = np.zeros(0, dtype=np.int64)
    if flag:
        counts_e = np.array([int((flat == ex).sum()) for ex in range(lo, hi)], dtype=np.int64)
    if drop_pad_mode == 0:
        idx = np.full(N, -1, dtype=np.int64)
        idx[S[:n_act]] = np.arange(n_act)
        rows = min(active_num, N) if active_num > 0 else N
        ex = np.zeros((rows, H))
        for d in range(min(rows, n_act)):
            ex[d] = xv[S[d] // K]
        if row_idx_type == 1:
            idx = S.astype(np.int64)
    else:
        C = expert_capacity
        idx = np.full(N, -1, dtype=np.int64)
        ex = np.zeros((E, C, H))
        fill = np.zeros(E, dtype=np.int64)
        for d in range(n_act):
            s = S[d]
            ee = flat[s]
            if fill[ee] < C:
                idx[s] = ee * C + fill[ee]
                ex[ee, fill[ee]] = xv[s // K]
            fill[ee] += 1
    if not flag:
        tok = np.zeros(0, dtype=np.int64)
    elif expert_tokens_num_type == 0:
        tok = np.cumsum(counts_e)
    elif expert_tokens_num_type == 1:
        tok = counts_e
    else:
        tok = np.zeros((E, 2), dtype=np.int64)
        j = 0
        for b, c in enumerate(counts_e):
            if c > 0:
                tok[j] = (lo + b, c)
                j += 1
    return ex, idx, tok


def moe_init_routing_grad(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode=0,
                          active_num=0):
    """grad_x[r] = sum over k of grad rows d = idx[r*K + k], d outside [0, rows) skipped."""
    g = as_f64(grad_expanded_x)
    idx = as_i64(expanded_row_idx)
    H = g.shape[-1]
    g = g.reshape(-1, H)
    rows = g.shape[0]
    R = idx.shape[0] // top_k
    out = np.zeros((R, H))
    for r in range(R):
        for k in range(top_k):
            d = idx[r * top_k + k]
            if 0 <= d < rows:
                out[r] += g[d]
    return out


# --------------------------------------------------------------------------------------------
# §9 ClippedSwiglu / ClippedSwigluGrad (D32; the clamp_mode 1 backward: docs/decisions.md L163)
# --------------------------------------------------------------------------------------------
def _clipped_fold(x, dim, interleaved):
    """x viewed as [pre, 2h] around dim (the split along the folded axis): (pre, h, A, B, the
    index arrays of A and B in the folded row)."""
    x = as_f64(x)
    d = dim % x.ndim
    pre = int(np.prod(x.shape[:d])) if d else 1
    rest = int(np.prod(x.shape[d:]))
    h = rest // 2
    xf = x.reshape(pre, rest)
    cols = np.arange(h)
    ia, ib = (2 * cols, 2 * cols + 1) if interleaved else (cols, cols + h)
    return pre, h, xf[:, ia], xf[:, ib], ia, ib


def clipped_swiglu(x, group_index=None, dim=-1, alpha=1.702, limit=7.0, bias=1.0,
                   interleaved=True, clamp_mode=0):
    """Returns (y like x with shape[dim] halved, its error scale). The attributes are taken in
    fp32, as the kernels take them."""
    xs = list(as_f64(x).shape)
    d = dim % len(xs)
    pre, h, A, B, _, _ = _clipped_fold(x, dim, interleaved)
    L, al, bi = f32(limit), f32(alpha), f32(bias)
    with np.errstate(invalid="ignore", over="ignore"):
        Bc = np.clip(B, -L, L)
        if clamp_mode == 0:
            Ac = np.minimum(A, L)
            s = sigmoid(al * Ac)
            y = Ac * s * (Bc + bi)
            mag = np.abs(Ac * s) * (np.abs(Bc) + abs(bi))
        else:
            y = np.minimum(A * sigmoid(A), L) * Bc
            mag = np.abs(y)
    rows = swiglu_trunc(pre, group_index)
    y[rows:] = 0.0
    mag[rows:] = 0.0
    xs[d] //= 2
    return y.reshape(xs), mag.reshape(xs)


def clipped_swiglu_grad(grad_y, x, group_index=None, dim=-1, alpha=1.702, limit=7.0, bias=1.0,
                        interleaved=True, clamp_mode=0):
    """Returns (grad_x like x, its error scale). Masks are inclusive: [A <= limit] (mode 0),
    [A sigmoid(A) <= limit] (mode 1), [-limit <= B <= limit]."""
    xs = as_f64(x).shape
    pre, h, A, B, ia, ib = _clipped_fold(x, dim, interleaved)
    g = as_f64(grad_y).reshape(pre, h)
    L, al, bi = f32(limit), f32(alpha), f32(bias)
    with np.errstate(invalid="ignore", over="ignore"):
        Bc = np.clip(B, -L, L)
        mb = (B >= -L) & (B <= L)
        if clamp_mode == 0:
            Ac = np.minimum(A, L)
            s = sigmoid(al * Ac)
            da = np.where(A <= L, g * (Bc + bi) * s * (1.0 + al * Ac * (1.0 - s)), 0.0)
            ma = np.abs(g) * (np.abs(Bc) + abs(bi)) * s * (1.0 + np.abs(al * Ac) * (1.0 - s))
            db = np.where(mb, g * Ac * s, 0.0)
        else:
            s = sigmoid(A)
            u = A * s
            da = np.where(u <= L, g * Bc * s * (1.0 + A * (1.0 - s)), 0.0)
            ma = np.abs(g * Bc) * s * (1.0 + np.abs(A) * (1.0 - s))
            db = np.where(mb, g * np.minimum(u, L), 0.0)
    gx = np.zeros((pre, 2 * h))
    mag = np.zeros((pre, 2 * h))
    gx[:, ia], gx[:, ib] = da, db
    mag[:, ia], mag[:, ib] = np.where(da == 0.0, 0.0, ma), np.abs(db)
    rows = swiglu_trunc(pre, group_index)
    gx[rows:] = 0.0
    mag[rows:] = 0.0
    return gx.reshape(xs), mag.reshape(xs)
