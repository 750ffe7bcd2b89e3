"""Validation rules of every operator (operators.md §1.6, §2.5, §3.6, §4.6, §5.6; decisions D2, D3,
D4, D6, D9, D11, D13, D18, D19, D20; docs/decisions.md L3, L4, L6-L9).

Each broken rule is its own case: the low-level ``moegrad._C.<op>`` is called with one rule
broken and every output POISONED beforehand; the test asserts ``moegrad.MoeError`` with the exact
status code, that the message names the offending argument (the Python names of docs/operators.md §7.2), and that
no tensor argument (output or input) changed by a single bit (D18: nothing written on failure).
A subset goes through the public API to check that it raises the same code. Valid edge cases
(zero rows, N = 1, clamp_limit = -1.0, the accepted index patterns, ...) must succeed and write
every output element.
"""

from __future__ import annotations

import pytest
import torch

import moegrad
from _util_validation import gen  # noqa: F401  (fixture)
from _util_validation import (assert_fully_written, assert_names_one_of, contains_int,
                              noncontig, poison, rand, randn, randperm, same_bytes, snapshot,
                              upstream)

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
I32, I64 = torch.int32, torch.int64
NAN, INF = float("nan"), float("inf")

NULLPTR, PARAM_INVALID, TILING, FINALIZE = 161001, 161002, 561002, 561103


def _C():
    return moegrad._C


# ----------------------------------------------------------------------------- builders ----
# Each builder returns a dict holding every argument of the _C call, valid and consistent.

def _rows_unique_idx(g, M, N, K, dtype=I32):
    if M == 0:
        return torch.zeros(0, K, dtype=dtype)
    return torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(M)]).to(dtype)


def b_gating_fwd(g, M=4, N=16, k=4, k_group=2, group_count=4, group_select_mode=0, renorm=0,
                 norm_type=1, out_flag=True, rsf=1.0, eps=1e-20, dtype=F32, bias=True):
    return dict(
        x=randn(g, M, N, dtype=dtype), bias=randn(g, N, dtype=dtype, scale=0.1) if bias else None,
        k=k, k_group=k_group, group_count=group_count, group_select_mode=group_select_mode,
        renorm=renorm, norm_type=norm_type, out_flag=out_flag, routed_scaling_factor=rsf, eps=eps,
        y=torch.empty(M, k, dtype=dtype), expert_idx=torch.empty(M, k, dtype=I32),
        norm_out=torch.empty(M, N, dtype=F32))


def b_gating_bwd(g, M=4, N=16, K=4, dtype=F32, renorm=0, norm_type=1, rsf=1.0, eps=1e-20):
    return dict(
        x_norm=rand(g, M, N, lo=0.05, hi=0.95), grad_y=upstream(g, M, K, dtype=dtype),
        expert_idx=_rows_unique_idx(g, M, N, min(K, N)) if K <= N else torch.zeros(M, K, dtype=I32),
        renorm=renorm, norm_type=norm_type, routed_scaling_factor=rsf, eps=eps,
        grad_x=torch.empty(M, N, dtype=dtype))


def _eid(g, E, R, K):
    return torch.randint(0, E, (R, K), generator=g, dtype=I64).to(I32)


def _drop_pad_idx(g, n, slots, drops=()):
    idx = torch.randperm(slots, generator=g)[:n].to(I32)
    for p in drops:
        if p < n:
            idx[p] = -1
    return idx


def b_fin_fwd(g, R=4, K=2, H=8, E=3, C=4, mode=0, dtype=F32, scales=True, bias=True, x1=True,
              x2=True, expert_idx=True, scales_dtype=None):
    if mode in (0, 2):
        ex = randn(g, R * K, H, dtype=dtype)
        idx = randperm(g, R * K)
    else:
        ex = randn(g, E, C, H, dtype=dtype)
        idx = _drop_pad_idx(g, R * K, E * C, drops=(1, 5))
    return dict(
        expanded_x=ex, expanded_row_idx=idx,
        x1=randn(g, R, H, dtype=dtype) if x1 else None,
        x2=randn(g, R, H, dtype=dtype) if x2 else None,
        bias=randn(g, E, H, dtype=dtype) if bias else None,
        scales=rand(g, R, K, dtype=scales_dtype or dtype) if scales else None,
        expert_idx=_eid(g, E, R, K) if expert_idx else None,
        drop_pad_mode=mode, out=torch.empty(R, H, dtype=dtype))


def b_fin_grad(g, R=4, K=2, H=8, E=3, C=4, mode=0, active_num=0, dtype=F32, scales=True,
               bias=True, expert_idx=True, expanded_x=True):
    RK = R * K
    if mode == 0:
        dim0 = active_num if 0 < active_num < RK else RK
        ex_shape = (dim0, H)
        idx = randperm(g, RK)
    else:
        ex_shape = (E, C, H)
        idx = _drop_pad_idx(g, RK, E * C, drops=(1, 5))
    has_scales = scales
    return dict(
        grad_y=upstream(g, R, H, dtype=dtype), expanded_row_idx=idx,
        expanded_x=randn(g, *ex_shape, dtype=dtype) if expanded_x else None,
        scales=rand(g, R, K, dtype=dtype) if has_scales else None,
        expert_idx=_eid(g, E, R, K) if expert_idx else None,
        bias=randn(g, E, H, dtype=dtype) if bias else None,
        drop_pad_mode=mode, active_num=active_num,
        expert_num=E if mode == 1 else 0, expert_capacity=C if mode == 1 else 0,
        grad_expanded_x=torch.empty(*ex_shape, dtype=dtype),
        grad_scales=torch.empty(R, K if has_scales else 1, dtype=dtype))


def b_swiglu_fwd(g, T=6, H=8, dtype=F32, weight=True, group_index=True, clamp=-1.0, lead=None):
    lead = tuple(lead) if lead is not None else (T,)
    return dict(
        x=randn(g, *lead, 2 * H, dtype=dtype),
        weight=rand(g, *lead, lo=0.1, hi=1.0) if weight else None,
        group_index=torch.tensor([2, 0, 3], dtype=I64) if group_index else None,
        clamp_limit=clamp, y=torch.empty(*lead, H, dtype=dtype))


def b_swiglu_bwd(g, T=6, H=8, dtype=F32, weight=True, y_origin=True, group_index=True,
                 clamp=-1.0, grad_weight=True):
    return dict(
        grad_y=upstream(g, T, H, dtype=dtype), x=randn(g, T, 2 * H, dtype=dtype),
        weight=rand(g, T, lo=0.1, hi=1.0) if weight else None,
        y_origin=randn(g, T, H, dtype=dtype) if y_origin else None,
        group_index=torch.tensor([2, 0, 3], dtype=I64) if group_index else None,
        clamp_limit=clamp, grad_x=torch.empty(T, 2 * H, dtype=dtype),
        grad_weight=torch.empty(T, dtype=F32) if (weight and grad_weight) else None)


OPS = {
    "gating_fwd": ("moe_gating_top_k",
                   ["x", "bias", "k", "k_group", "group_count", "group_select_mode", "renorm",
                    "norm_type", "out_flag", "routed_scaling_factor", "eps", "y", "expert_idx",
                    "norm_out"],
                   ["y", "expert_idx", "norm_out"], b_gating_fwd),
    "gating_bwd": ("moe_gating_top_k_backward",
                   ["x_norm", "grad_y", "expert_idx", "renorm", "norm_type",
                    "routed_scaling_factor", "eps", "grad_x"],
                   ["grad_x"], b_gating_bwd),
    "fin_fwd": ("moe_finalize_routing",
                ["expanded_x", "expanded_row_idx", "x1", "x2", "bias", "scales", "expert_idx",
                 "drop_pad_mode", "out"],
                ["out"], b_fin_fwd),
    "fin_grad": ("moe_finalize_routing_grad",
                 ["grad_y", "expanded_row_idx", "expanded_x", "scales", "expert_idx", "bias",
                  "drop_pad_mode", "active_num", "expert_num", "expert_capacity",
                  "grad_expanded_x", "grad_scales"],
                 ["grad_expanded_x", "grad_scales"], b_fin_grad),
    "swiglu_fwd": ("swiglu_group", ["x", "weight", "group_index", "clamp_limit", "y"], ["y"],
                   b_swiglu_fwd),
    "swiglu_bwd": ("swiglu_group_quant_backward",
                   ["grad_y", "x", "weight", "y_origin", "group_index", "clamp_limit", "grad_x",
                    "grad_weight"],
                   ["grad_x", "grad_weight"], b_swiglu_bwd),
}


def call_c(op, d):
    cname, order, _, _ = OPS[op]
    return getattr(_C(), cname)(*[d[k] for k in order])


# ---------------------------------------------------------------------------- mutations ----

def none(key):
    def m(d, g):
        d[key] = None
    return m


def to(key, dtype):
    def m(d, g):
        d[key] = d[key].to(dtype)
    return m


def nc(key):
    def m(d, g):
        d[key] = noncontig(d[key])
    return m


def attr(key, value):
    def m(d, g):
        d[key] = value
    return m


def new(key, *shape, dtype=None):
    """Replace d[key] by a tensor of another shape (same dtype; floats random, ints zero)."""
    def m(d, g):
        dt = dtype or d[key].dtype
        d[key] = (randn(g, *shape, dtype=dt) if dt.is_floating_point
                  else torch.zeros(shape, dtype=dt))
    return m


def reshape(key, *shape):
    def m(d, g):
        d[key] = d[key].reshape(*shape).clone()
    return m


def chain(*ms):
    def m(d, g):
        for f in ms:
            f(d, g)
    return m


def place(idx: torch.Tensor, pos: int, val: int) -> None:
    """Make idx[pos] == val, swapping with an existing occurrence so no duplicate is created."""
    flat = idx.view(-1)
    hit = (flat == val).nonzero()
    if hit.numel():
        j = int(hit[0])
        flat[j] = flat[pos].clone()
    flat[pos] = val


def set_idx(key, pos, val):
    def m(d, g):
        place(d[key], pos, val)
    return m


def set_raw(key, pos, val):
    def m(d, g):
        d[key].view(-1)[pos] = val
    return m


def dup_idx(key, pos_a, pos_b, val):
    def m(d, g):
        place(d[key], pos_a, val)
        d[key].view(-1)[pos_b] = val
    return m


# ------------------------------------------------------------------------------- cases -----
# (id, op, builder kwargs, mutation, code, names (any of), ints required in the message)
# ints: a list of requirements; each requirement is a list of alternatives; an alternative is an
# int or a tuple of ints that must all appear.

CASES = []


def case(cid, op, kw, mut, code, names, ints=()):
    CASES.append(pytest.param(op, kw, mut, code, names, ints, id=f"{op}-{cid}"))


# --- gating forward (§2.5, D2, D4, D13, D18, D19, L3) ------------------------------------------
G = "gating_fwd"
for arg in ("x", "y", "expert_idx", "norm_out"):
    case(f"null-{arg}", G, {}, none(arg), NULLPTR, arg)
case("x-f64", G, {}, chain(to("x", F64), to("y", F64), to("bias", F64)), PARAM_INVALID, "x")
case("x-int32", G, {}, to("x", I32), PARAM_INVALID, "x")
case("bias-dtype", G, {}, to("bias", F16), PARAM_INVALID, "bias")
case("bias-dtype-bf16-x", G, dict(dtype=BF16), to("bias", F32), PARAM_INVALID, "bias")
case("y-dtype", G, {}, to("y", F16), PARAM_INVALID, "y")
case("expert_idx-int64", G, {}, to("expert_idx", I64), PARAM_INVALID, "expert_idx")
case("expert_idx-f32", G, {}, to("expert_idx", F32), PARAM_INVALID, "expert_idx")
case("norm_out-f16", G, {}, to("norm_out", F16), PARAM_INVALID, "norm_out")
case("norm_out-bf16-x", G, dict(dtype=BF16), to("norm_out", BF16), PARAM_INVALID, "norm_out")
for arg in ("x", "bias", "y", "expert_idx", "norm_out"):
    case(f"noncontig-{arg}", G, {}, nc(arg), PARAM_INVALID, arg)
case("x-rank1", G, {}, new("x", 16), TILING, "x")
case("x-rank3", G, {}, new("x", 1, 4, 16), TILING, "x")
case("x-rank0", G, {}, new("x"), TILING, "x")
case("x-rank9", G, {}, new("x", 1, 1, 1, 1, 1, 1, 1, 4, 16), TILING, "x")
case("N-2049", G, dict(N=2049, k=1, k_group=1, group_count=1, bias=False), None, TILING, "x",
     [[2049]])
case("N-0", G, dict(N=0, k=1, k_group=1, group_count=1, bias=False), None, TILING, ("x", "k"))
case("bias-rank2", G, {}, new("bias", 1, 16), TILING, "bias")
case("bias-len", G, {}, new("bias", 15), TILING, "bias", [[15]])
case("k-0", G, {}, chain(attr("k", 0), new("y", 4, 0), new("expert_idx", 4, 0)), TILING, "k")
case("k-neg", G, {}, attr("k", -1), TILING, "k")
case("k-gt-N", G, dict(k_group=4), chain(attr("k", 17), new("y", 4, 17), new("expert_idx", 4, 17)),
     TILING, "k", [[17]])
case("k-gt-kgroup-times-groupsize", G, dict(k_group=2, group_count=4),
     chain(attr("k", 9), new("y", 4, 9), new("expert_idx", 4, 9)), TILING, "k", [[9]])
case("k_group-0", G, {}, attr("k_group", 0), TILING, "k_group")
case("k_group-neg", G, {}, attr("k_group", -1), TILING, "k_group")
case("k_group-gt-group_count", G, {}, attr("k_group", 5), TILING, "k_group", [[5]])
case("group_count-0", G, {}, attr("group_count", 0), TILING, ("group_count", "k_group"))
case("group_count-neg", G, {}, attr("group_count", -4), TILING, ("group_count", "k_group"))
case("group_count-not-divisor", G, dict(k_group=2), attr("group_count", 3), TILING, "group_count",
     [[3]])
case("group-size-1-with-mode1", G, dict(group_count=16, k_group=8, group_select_mode=1), None,
     TILING, ("group_select_mode", "group_count"))
case("group_count-roundup32", G, dict(N=130, group_count=65, k_group=1, k=2, bias=False), None,
     TILING, "group_count")
case("group_select_mode-2", G, {}, attr("group_select_mode", 2), TILING, "group_select_mode")
case("group_select_mode-neg", G, {}, attr("group_select_mode", -1), TILING, "group_select_mode")
case("norm_type-3", G, {}, attr("norm_type", 3), TILING, "norm_type", [[3]])
case("norm_type-neg", G, {}, attr("norm_type", -1), TILING, "norm_type")
case("renorm-2", G, {}, attr("renorm", 2), TILING, "renorm")
case("renorm-neg", G, {}, attr("renorm", -1), TILING, "renorm")
case("eps-nan", G, {}, attr("eps", NAN), TILING, "eps")
case("eps-inf", G, {}, attr("eps", INF), TILING, "eps")
case("eps-neginf", G, {}, attr("eps", -INF), TILING, "eps")
case("rsf-nan", G, {}, attr("routed_scaling_factor", NAN), TILING, "routed_scaling_factor")
case("rsf-inf", G, {}, attr("routed_scaling_factor", INF), TILING, "routed_scaling_factor")
case("y-cols", G, {}, new("y", 4, 3), TILING, "y")
case("y-rows", G, {}, new("y", 5, 4), TILING, "y")
case("y-rank3", G, {}, new("y", 4, 4, 1), TILING, "y")
case("expert_idx-cols", G, {}, new("expert_idx", 4, 5), TILING, "expert_idx")
case("expert_idx-rank1", G, {}, new("expert_idx", 16), TILING, "expert_idx")
case("norm_out-cols", G, {}, new("norm_out", 4, 15), TILING, "norm_out")
case("norm_out-rows", G, {}, new("norm_out", 3, 16), TILING, "norm_out")
case("norm_out-shape-out_flag-false", G, dict(out_flag=False), new("norm_out", 4, 15), TILING,
     "norm_out")

# --- gating backward (§1.6, D2, D3: everything but null is 161002, L3, D6) ----------------------
G = "gating_bwd"
for arg in ("x_norm", "grad_y", "expert_idx", "grad_x"):
    case(f"null-{arg}", G, {}, none(arg), NULLPTR, arg)
case("x_norm-f16", G, {}, to("x_norm", F16), PARAM_INVALID, "x_norm")
case("x_norm-bf16", G, {}, to("x_norm", BF16), PARAM_INVALID, "x_norm")
case("x_norm-f64", G, {}, to("x_norm", F64), PARAM_INVALID, "x_norm")
case("grad_y-f64", G, {}, chain(to("grad_y", F64), to("grad_x", F64)), PARAM_INVALID, "grad_y")
case("grad_y-int32", G, {}, chain(to("grad_y", I32), to("grad_x", I32)), PARAM_INVALID, "grad_y")
case("expert_idx-int64", G, {}, to("expert_idx", I64), PARAM_INVALID, "expert_idx")
case("expert_idx-f32", G, {}, to("expert_idx", F32), PARAM_INVALID, "expert_idx")
case("grad_x-dtype", G, {}, to("grad_x", F16), PARAM_INVALID, "grad_x")
case("grad_x-dtype-D15", G, dict(dtype=F16), to("grad_x", F32), PARAM_INVALID, "grad_x")
for arg in ("x_norm", "grad_y", "expert_idx", "grad_x"):
    case(f"noncontig-{arg}", G, {}, nc(arg), PARAM_INVALID, arg)
case("x_norm-rank1", G, {}, new("x_norm", 16), PARAM_INVALID, "x_norm")
case("x_norm-rank3", G, {}, new("x_norm", 1, 4, 16), PARAM_INVALID, "x_norm")
case("N-2049", G, dict(N=2049, K=2), None, PARAM_INVALID, "x_norm", [[2049]])
case("N-1-D2", G, dict(N=1, K=1), None, PARAM_INVALID, "x_norm")
case("N-0", G, dict(N=0, K=1), None, PARAM_INVALID, ("x_norm", "grad_y", "expert_idx"))
case("grad_y-rank1", G, {}, new("grad_y", 16), PARAM_INVALID, "grad_y")
case("grad_y-rank3", G, {}, new("grad_y", 1, 4, 4), PARAM_INVALID, "grad_y")
case("grad_y-rows", G, {}, new("grad_y", 5, 4), PARAM_INVALID, "grad_y")
case("K-0", G, dict(K=0), None, PARAM_INVALID, ("grad_y", "expert_idx"))
case("K-gt-N", G, dict(N=4, K=5), None, PARAM_INVALID, ("grad_y", "expert_idx"))
case("expert_idx-rank1", G, {}, new("expert_idx", 16), PARAM_INVALID, "expert_idx")
case("expert_idx-rows", G, {}, new("expert_idx", 5, 4), PARAM_INVALID, "expert_idx")
case("expert_idx-cols", G, {}, new("expert_idx", 4, 3), PARAM_INVALID, "expert_idx")
case("grad_x-rank1", G, {}, new("grad_x", 64), PARAM_INVALID, "grad_x")
case("grad_x-rank3", G, {}, new("grad_x", 1, 4, 16), PARAM_INVALID, "grad_x")
case("grad_x-cols", G, {}, new("grad_x", 4, 15), PARAM_INVALID, "grad_x")
case("grad_x-rows", G, {}, new("grad_x", 5, 16), PARAM_INVALID, "grad_x")
case("norm_type-3", G, {}, attr("norm_type", 3), PARAM_INVALID, "norm_type", [[3]])
case("softmax-renorm-2", G, dict(norm_type=0), attr("renorm", 2), PARAM_INVALID, "renorm", [[2]])
case("norm_type-neg", G, {}, attr("norm_type", -1), PARAM_INVALID, "norm_type")
case("eps-nan", G, {}, attr("eps", NAN), PARAM_INVALID, "eps")
case("eps-inf", G, {}, attr("eps", INF), PARAM_INVALID, "eps")
case("rsf-nan", G, {}, attr("routed_scaling_factor", NAN), PARAM_INVALID, "routed_scaling_factor")
case("rsf-neginf", G, {}, attr("routed_scaling_factor", -INF), PARAM_INVALID,
     "routed_scaling_factor")
# D6: host index values in [0, N); message names the first bad position and value.
case("D6-idx-too-large", G, dict(M=5, N=16, K=3), set_raw("expert_idx", 10, 23), PARAM_INVALID,
     "expert_idx", [[23], [10, (3, 1)]])
case("D6-idx-negative", G, dict(M=5, N=16, K=3), set_raw("expert_idx", 7, -1), PARAM_INVALID,
     "expert_idx", [[-1], [7, (2, 1)]])
case("D6-idx-first-bad-named", G, dict(M=5, N=16, K=3),
     chain(set_raw("expert_idx", 5, 29), set_raw("expert_idx", 13, 41)), PARAM_INVALID,
     "expert_idx", [[29], [5, (1, 2)]])

# --- finalize routing forward (§4.6, L4, D6) ---------------------------------------------------
G = "fin_fwd"
for arg in ("expanded_x", "expanded_row_idx", "out"):
    case(f"null-{arg}", G, {}, none(arg), NULLPTR, arg)
case("expanded_x-f64", G, dict(x1=False, x2=False, bias=False, scales=False),
     chain(to("expanded_x", F64), to("out", F64)), PARAM_INVALID, "expanded_x")
case("expanded_x-int32", G, dict(x1=False, x2=False, bias=False, scales=False),
     to("expanded_x", I32), PARAM_INVALID, "expanded_x")
case("expanded_row_idx-int64", G, {}, to("expanded_row_idx", I64), PARAM_INVALID,
     "expanded_row_idx")
case("expanded_row_idx-f32", G, {}, to("expanded_row_idx", F32), PARAM_INVALID,
     "expanded_row_idx")
case("x1-dtype", G, {}, to("x1", F16), PARAM_INVALID, "x1")
case("x2-dtype", G, {}, to("x2", F16), PARAM_INVALID, "x2")
case("bias-dtype", G, {}, to("bias", F16), PARAM_INVALID, "bias")
case("scales-f64", G, {}, to("scales", F64), PARAM_INVALID, "scales")
case("scales-int32", G, {}, to("scales", I32), PARAM_INVALID, "scales")
case("expert_idx-int64", G, {}, to("expert_idx", I64), PARAM_INVALID, "expert_idx")
case("expert_idx-f32", G, {}, to("expert_idx", F32), PARAM_INVALID, "expert_idx")
case("out-dtype", G, {}, to("out", F16), PARAM_INVALID, "out")
for arg in ("expanded_x", "expanded_row_idx", "x1", "x2", "bias", "scales", "expert_idx", "out"):
    case(f"noncontig-{arg}", G, {}, nc(arg), PARAM_INVALID, arg)
case("drop_pad_mode-4", G, {}, attr("drop_pad_mode", 4), FINALIZE, "drop_pad_mode", [[4]])
case("drop_pad_mode-neg", G, {}, attr("drop_pad_mode", -1), FINALIZE, "drop_pad_mode")
case("expanded_x-rank3-mode0", G, {}, new("expanded_x", 2, 4, 8), FINALIZE, "expanded_x")
case("expanded_x-rank2-mode1", G, dict(mode=1), new("expanded_x", 12, 8), FINALIZE, "expanded_x")
case("expanded_x-rank3-mode2", G, dict(mode=2), new("expanded_x", 2, 4, 8), FINALIZE, "expanded_x")
case("expanded_x-rank2-mode3", G, dict(mode=3), new("expanded_x", 12, 8), FINALIZE, "expanded_x")
case("expanded_row_idx-rank2", G, {}, reshape("expanded_row_idx", 8, 1), FINALIZE,
     "expanded_row_idx")
for arg, shp in (("x1", (4, 8, 1)), ("x2", (32,)), ("bias", (24,)), ("scales", (8,)),
                 ("expert_idx", (4, 2, 1))):
    case(f"{arg}-rank", G, {}, new(arg, *shp), FINALIZE, arg)
case("x1-rank9", G, {}, new("x1", 1, 1, 1, 1, 1, 1, 1, 4, 8), FINALIZE, "x1")
case("expert_idx-dim1-ne-scales-dim1", G, {}, new("expert_idx", 4, 3), FINALIZE,
     ("expert_idx", "scales"))
case("x1-rows", G, {}, new("x1", 5, 8), FINALIZE, "x1")
case("x2-rows", G, {}, new("x2", 3, 8), FINALIZE, "x2")
case("scales-rows", G, {}, new("scales", 5, 2), FINALIZE, "scales")
case("expert_idx-rows", G, {}, new("expert_idx", 5, 2), FINALIZE, "expert_idx")
case("x1-cols", G, {}, new("x1", 4, 9), FINALIZE, "x1")
case("x2-cols", G, {}, new("x2", 4, 7), FINALIZE, "x2")
case("bias-cols", G, {}, new("bias", 3, 9), FINALIZE, "bias")
case("x2-without-x1", G, dict(x1=False), None, FINALIZE, ("x2", "x1"))
case("bias-without-expert_idx", G, dict(expert_idx=False), None, FINALIZE, ("bias", "expert_idx"))
case("H-0", G, dict(H=0), None, FINALIZE, ("expanded_x", "out", "x1", "x2", "bias"))
case("expanded_x-cols", G, dict(x1=False, x2=False, bias=False), new("expanded_x", 8, 9),
     FINALIZE, ("expanded_x", "out"))
case("idx-numel-ne-RK", G, {}, new("expanded_row_idx", 7), FINALIZE, "expanded_row_idx")
case("K-0", G, dict(K=0), None, FINALIZE, ("scales", "expert_idx", "expanded_row_idx"))
case("L4-no-scales-numel-not-multiple-of-R", G,
     dict(R=3, K=2, scales=False, expert_idx=False, bias=False),
     lambda d, g: d.__setitem__("expanded_row_idx", randperm(g, 7)),
     FINALIZE, ("expanded_row_idx", "out"))
case("L4-expert_idx-gives-K", G, dict(scales=False, bias=False),
     lambda d, g: d.__setitem__("expanded_row_idx", randperm(g, 7)), FINALIZE,
     ("expanded_row_idx", "expert_idx"))
case("out-rank1", G, {}, new("out", 32), FINALIZE, "out")
case("out-cols", G, dict(x1=False, x2=False, bias=False), new("out", 4, 9), FINALIZE,
     ("out", "expanded_x"))
# D6/D29 (host indices): dropless [-1, R*K), drop-pad [-1, E*C), each valid value at most once.
RK = dict(R=7, K=3, E=4, C=8)
case("D6-mode0-too-large", G, RK, set_raw("expanded_row_idx", 13, 37), FINALIZE,
     "expanded_row_idx", [[37], [13]])
case("D6-mode0-equal-RK", G, RK, set_raw("expanded_row_idx", 13, 21), FINALIZE,
     "expanded_row_idx", [[21], [13]])
case("D29-mode0-minus2", G, RK, set_raw("expanded_row_idx", 13, -2), FINALIZE,
     "expanded_row_idx", [[-2], [13]])
case("D6-mode0-duplicate", G, RK, dup_idx("expanded_row_idx", 6, 17, 12), FINALIZE,
     "expanded_row_idx", [[12], [6, 17]])
case("D6-mode2-duplicate", G, dict(RK, mode=2), dup_idx("expanded_row_idx", 6, 17, 12), FINALIZE,
     "expanded_row_idx", [[12], [6, 17]])
case("D6-mode1-minus2", G, dict(RK, mode=1), set_raw("expanded_row_idx", 13, -2), FINALIZE,
     "expanded_row_idx", [[-2], [13]])
case("D6-mode1-equal-EC", G, dict(RK, mode=1), set_raw("expanded_row_idx", 13, 32), FINALIZE,
     "expanded_row_idx", [[32], [13]])
case("D6-mode1-duplicate", G, dict(RK, mode=1), dup_idx("expanded_row_idx", 6, 17, 12), FINALIZE,
     "expanded_row_idx", [[12], [6, 17]])
case("D6-mode3-too-large", G, dict(RK, mode=3), set_raw("expanded_row_idx", 13, 45), FINALIZE,
     "expanded_row_idx", [[45], [13]])
case("D6-expert_idx-ge-E", G, RK, set_raw("expert_idx", 11, 4), FINALIZE, "expert_idx",
     [[11, (3, 2)]])
case("D6-expert_idx-negative", G, RK, set_raw("expert_idx", 11, -3), FINALIZE, "expert_idx",
     [[-3], [11, (3, 2)]])

# --- finalize routing grad (§3.6, D5, D6) ------------------------------------------------------
G = "fin_grad"
for arg in ("grad_y", "expanded_row_idx", "grad_expanded_x", "grad_scales"):
    case(f"null-{arg}", G, {}, none(arg), NULLPTR, arg)
case("grad_y-f64", G, dict(K=1, scales=False, bias=False, expert_idx=False, expanded_x=False),
     chain(to("grad_y", F64), to("grad_expanded_x", F64), to("grad_scales", F64)),
     PARAM_INVALID, "grad_y")
case("grad_y-int32", G, dict(K=1, scales=False, bias=False, expert_idx=False, expanded_x=False),
     to("grad_y", I32), PARAM_INVALID, "grad_y")
case("expanded_row_idx-int64", G, {}, to("expanded_row_idx", I64), PARAM_INVALID,
     "expanded_row_idx")
case("expanded_row_idx-f32", G, {}, to("expanded_row_idx", F32), PARAM_INVALID,
     "expanded_row_idx")
case("expanded_x-dtype", G, {}, to("expanded_x", F16), PARAM_INVALID, "expanded_x")
case("scales-f64", G, {}, chain(to("scales", F64), to("grad_scales", F64)), PARAM_INVALID,
     "scales")
case("expert_idx-int64", G, {}, to("expert_idx", I64), PARAM_INVALID, "expert_idx")
case("bias-dtype", G, {}, to("bias", F16), PARAM_INVALID, "bias")
case("grad_expanded_x-dtype", G, {}, to("grad_expanded_x", F16), PARAM_INVALID, "grad_expanded_x")
case("grad_scales-dtype", G, {}, to("grad_scales", F16), PARAM_INVALID, "grad_scales")
case("grad_scales-dtype-no-scales-D5", G, dict(K=1, scales=False), to("grad_scales", F16),
     PARAM_INVALID, "grad_scales")
for arg in ("grad_y", "expanded_row_idx", "expanded_x", "scales", "expert_idx", "bias",
            "grad_expanded_x", "grad_scales"):
    case(f"noncontig-{arg}", G, {}, nc(arg), PARAM_INVALID, arg)
case("drop_pad_mode-2", G, {}, attr("drop_pad_mode", 2), FINALIZE, "drop_pad_mode", [[2]])
case("drop_pad_mode-3", G, {}, attr("drop_pad_mode", 3), FINALIZE, "drop_pad_mode", [[3]])
case("drop_pad_mode-neg", G, {}, attr("drop_pad_mode", -1), FINALIZE, "drop_pad_mode")
case("mode1-expert_num-0", G, dict(mode=1, bias=False), attr("expert_num", 0), FINALIZE,
     "expert_num")
case("mode1-expert_num-neg", G, dict(mode=1, bias=False), attr("expert_num", -3), FINALIZE,
     "expert_num")
case("mode1-expert_capacity-0", G, dict(mode=1), attr("expert_capacity", 0), FINALIZE,
     "expert_capacity")
case("grad_y-rank1", G, {}, new("grad_y", 32), FINALIZE, "grad_y")
case("grad_y-rank3", G, {}, new("grad_y", 1, 4, 8), FINALIZE, "grad_y")
case("expanded_row_idx-rank2", G, {}, reshape("expanded_row_idx", 4, 2), FINALIZE,
     "expanded_row_idx")
case("scales-without-expanded_x", G, {}, none("expanded_x"), FINALIZE, "expanded_x")
case("expanded_x-rank3-mode0", G, {}, new("expanded_x", 2, 4, 8), FINALIZE, "expanded_x")
case("expanded_x-rank2-mode1", G, dict(mode=1), new("expanded_x", 12, 8), FINALIZE, "expanded_x")
case("scales-rank1", G, {}, new("scales", 8), FINALIZE, "scales")
case("scales-rank3", G, {}, new("scales", 4, 2, 1), FINALIZE, "scales")
case("expanded_x-rows-mode0", G, {}, new("expanded_x", 9, 8), FINALIZE, "expanded_x")
case("expanded_x-rows-active_num", G, dict(active_num=5), new("expanded_x", 8, 8), FINALIZE,
     "expanded_x")
case("expanded_x-EC-mode1", G, dict(mode=1), new("expanded_x", 3, 5, 8), FINALIZE, "expanded_x")
case("expanded_x-cols", G, {}, new("expanded_x", 8, 9), FINALIZE, "expanded_x")
case("scales-rows", G, {}, new("scales", 5, 2), FINALIZE, "scales")
case("scales-numel", G, dict(bias=False, expert_idx=False),
     chain(new("scales", 4, 3), new("grad_scales", 4, 3)), FINALIZE,
     ("scales", "expanded_row_idx"))
case("bias-without-expert_idx", G, {}, none("expert_idx"), FINALIZE, ("expert_idx", "bias"))
case("expert_idx-rank1", G, {}, new("expert_idx", 8), FINALIZE, "expert_idx")
case("expert_idx-rank3", G, {}, new("expert_idx", 4, 2, 1), FINALIZE, "expert_idx")
case("bias-rank1", G, {}, new("bias", 24), FINALIZE, "bias")
case("bias-rank3", G, {}, new("bias", 3, 8, 1), FINALIZE, "bias")
case("expert_idx-rows", G, {}, new("expert_idx", 5, 2), FINALIZE, "expert_idx")
case("expert_idx-numel", G, {}, new("expert_idx", 4, 3), FINALIZE, "expert_idx")
case("bias-dim0-0", G, {}, new("bias", 0, 8), FINALIZE, "bias")
case("bias-dim0-ne-expert_num-mode1", G, dict(mode=1), new("bias", 4, 8), FINALIZE,
     ("bias", "expert_num"))
case("bias-cols", G, {}, new("bias", 3, 9), FINALIZE, "bias")
case("no-scales-K-not-1", G, dict(scales=False, bias=False, expert_idx=False), None, FINALIZE,
     ("grad_y", "expanded_row_idx"))
case("grad_expanded_x-rank1", G, {}, new("grad_expanded_x", 64), FINALIZE, "grad_expanded_x")
case("grad_expanded_x-rows-mode0", G, {}, new("grad_expanded_x", 7, 8), FINALIZE,
     "grad_expanded_x")
case("grad_expanded_x-EC-mode1", G, dict(mode=1), new("grad_expanded_x", 3, 5, 8), FINALIZE,
     "grad_expanded_x")
case("grad_expanded_x-cols", G, {}, new("grad_expanded_x", 8, 9), FINALIZE, "grad_expanded_x")
case("grad_scales-rows", G, {}, new("grad_scales", 5, 2), FINALIZE, "grad_scales")
case("grad_scales-numel", G, {}, new("grad_scales", 4, 3), FINALIZE, "grad_scales")
case("grad_scales-rank1", G, {}, new("grad_scales", 8), FINALIZE, "grad_scales")
case("H-0", G, dict(H=0), None, FINALIZE, ("grad_y", "expanded_x", "grad_expanded_x", "bias"))
case("K-0", G, dict(K=0), None, FINALIZE,
     ("scales", "expert_idx", "expanded_row_idx", "grad_scales"))
RKg = dict(R=7, K=3, E=4, C=8)
case("D6-mode0-too-large", G, RKg, set_raw("expanded_row_idx", 13, 37), FINALIZE,
     "expanded_row_idx", [[37], [13]])
case("D29-mode0-minus2", G, RKg, set_raw("expanded_row_idx", 13, -2), FINALIZE,
     "expanded_row_idx", [[-2], [13]])
case("D6-mode0-duplicate", G, RKg, dup_idx("expanded_row_idx", 6, 17, 12), FINALIZE,
     "expanded_row_idx", [[12], [6, 17]])
case("D6-mode1-minus2", G, dict(RKg, mode=1), set_raw("expanded_row_idx", 13, -2), FINALIZE,
     "expanded_row_idx", [[-2], [13]])
case("D6-mode1-equal-EC", G, dict(RKg, mode=1), set_raw("expanded_row_idx", 13, 32), FINALIZE,
     "expanded_row_idx", [[32], [13]])
case("D6-mode1-duplicate", G, dict(RKg, mode=1), dup_idx("expanded_row_idx", 6, 17, 12),
     FINALIZE, "expanded_row_idx", [[12], [6, 17]])
case("D6-expert_idx-ge-E", G, RKg, set_raw("expert_idx", 11, 4), FINALIZE, "expert_idx",
     [[11, (3, 2)]])
case("D6-expert_idx-negative", G, RKg, set_raw("expert_idx", 11, -3), FINALIZE, "expert_idx",
     [[-3], [11, (3, 2)]])

# --- SwiGLU forward (L9: §5.6 codes) -----------------------------------------------------------
G = "swiglu_fwd"
for arg in ("x", "y"):
    case(f"null-{arg}", G, {}, none(arg), NULLPTR, arg)
case("x-f64", G, {}, chain(to("x", F64), to("y", F64)), PARAM_INVALID, "x")
case("x-int32", G, {}, to("x", I32), PARAM_INVALID, "x")
case("weight-f16", G, {}, to("weight", F16), PARAM_INVALID, "weight")
case("weight-bf16-x", G, dict(dtype=BF16), to("weight", BF16), PARAM_INVALID, "weight")
case("group_index-int32", G, {}, to("group_index", I32), PARAM_INVALID, "group_index")
case("group_index-f32", G, {}, to("group_index", F32), PARAM_INVALID, "group_index")
case("y-dtype", G, {}, to("y", F16), PARAM_INVALID, "y")
for arg in ("x", "weight", "group_index", "y"):
    case(f"noncontig-{arg}", G, {}, nc(arg), PARAM_INVALID, arg)
for name, c in (("0", 0.0), ("neg-half", -0.5), ("neg-2", -2.0), ("nan", NAN), ("neginf", -INF),
                ("neg-zero", -0.0)):
    case(f"clamp_limit-{name}", G, {}, attr("clamp_limit", c), TILING, "clamp_limit")
case("x-odd-last-dim", G, {}, new("x", 6, 17), TILING, "x", [[17]])
case("x-rank0", G, dict(weight=False), new("x"), TILING, "x")
case("H-0", G, dict(H=0), None, TILING, ("x", "y"))
case("weight-numel-more", G, {}, new("weight", 7, dtype=F32), TILING, "weight")
case("weight-numel-less", G, {}, new("weight", 5, dtype=F32), TILING, "weight")
case("weight-3d-lead-mismatch", G, dict(lead=(2, 3)), new("weight", 3, 3, dtype=F32), TILING,
     "weight")
case("group_index-rank2", G, {}, new("group_index", 3, 1), TILING, "group_index")
case("group_index-rank0", G, {}, new("group_index"), TILING, "group_index")
case("x-rank9", G, dict(weight=False),
     chain(new("x", 1, 1, 1, 1, 1, 1, 1, 6, 16), new("y", 1, 1, 1, 1, 1, 1, 1, 6, 8)), TILING,
     "x")
case("y-cols", G, {}, new("y", 6, 9), TILING, "y")
case("y-rows", G, {}, new("y", 7, 8), TILING, "y")
case("y-rank3", G, {}, new("y", 1, 6, 8), TILING, "y")

# --- SwiGLU backward (§5.6, D11) ---------------------------------------------------------------
G = "swiglu_bwd"
for arg in ("grad_y", "x", "grad_x"):
    case(f"null-{arg}", G, {}, none(arg), NULLPTR, arg)
case("grad_y-f64", G, {}, chain(to("grad_y", F64), to("x", F64), to("y_origin", F64),
                               to("grad_x", F64)), PARAM_INVALID, ("grad_y", "x"))
case("x-f64", G, {}, to("x", F64), PARAM_INVALID, "x")
case("x-int32", G, {}, to("x", I32), PARAM_INVALID, "x")
case("grad_y-ne-x-dtype", G, {}, to("grad_y", F16), PARAM_INVALID, ("grad_y", "x"))
case("weight-f16", G, {}, to("weight", F16), PARAM_INVALID, "weight")
case("y_origin-dtype", G, {}, to("y_origin", F16), PARAM_INVALID, "y_origin")
case("group_index-int32", G, {}, to("group_index", I32), PARAM_INVALID, "group_index")
case("grad_x-dtype", G, {}, to("grad_x", F16), PARAM_INVALID, "grad_x")
case("grad_weight-f16", G, {}, to("grad_weight", F16), PARAM_INVALID, "grad_weight")
case("grad_weight-f64", G, {}, to("grad_weight", F64), PARAM_INVALID, "grad_weight")
case("grad_weight-bf16-x", G, dict(dtype=BF16), to("grad_weight", BF16), PARAM_INVALID,
     "grad_weight")
for arg in ("grad_y", "x", "weight", "y_origin", "group_index", "grad_x", "grad_weight"):
    case(f"noncontig-{arg}", G, {}, nc(arg), PARAM_INVALID, arg)
for name, c in (("0", 0.0), ("neg-half", -0.5), ("neg-2", -2.0), ("nan", NAN), ("neginf", -INF)):
    case(f"clamp_limit-{name}", G, {}, attr("clamp_limit", c), TILING, "clamp_limit")
case("rank-mismatch", G, {}, chain(new("grad_y", 1, 6, 8), new("y_origin", 1, 6, 8)), TILING,
     ("grad_y", "x"))
case("leading-dims-differ", G, dict(weight=False, y_origin=False), new("grad_y", 7, 8), TILING,
     ("grad_y", "x"))
case("x-odd-last-dim", G, {}, chain(new("x", 6, 17), new("grad_x", 6, 17)), TILING, "x", [[17]])
case("grad_y-last-dim", G, {}, chain(new("grad_y", 6, 9), new("y_origin", 6, 9)), TILING,
     ("grad_y", "x"))
case("weight-numel", G, {}, chain(new("weight", 7), new("grad_weight", 7)), TILING, "weight")
case("y_origin-cols", G, {}, new("y_origin", 6, 9), TILING, "y_origin")
case("y_origin-rows", G, {}, new("y_origin", 5, 8), TILING, "y_origin")
case("weight-without-y_origin", G, dict(y_origin=False), None, TILING, ("y_origin", "weight"))
case("group_index-rank2", G, {}, new("group_index", 3, 1), TILING, "group_index")
case("grad_x-cols", G, {}, new("grad_x", 6, 18), TILING, "grad_x")
case("grad_x-rank3", G, {}, new("grad_x", 1, 6, 16), TILING, "grad_x")
case("grad_weight-numel", G, {}, new("grad_weight", 7), TILING, "grad_weight")
case("grad_weight-shape-ne-weight", G, {}, new("grad_weight", 6, 1), TILING, "grad_weight")
case("H-0", G, dict(H=0), None, TILING, ("grad_y", "x", "y_origin", "grad_x"))
case("rank9", G, dict(weight=False, y_origin=False),
     chain(new("grad_y", 1, 1, 1, 1, 1, 1, 1, 6, 8), new("x", 1, 1, 1, 1, 1, 1, 1, 6, 16),
           new("grad_x", 1, 1, 1, 1, 1, 1, 1, 6, 16)), TILING, ("grad_y", "x"))
case("rank0", G, dict(weight=False, y_origin=False),
     chain(new("grad_y"), new("x"), new("grad_x")), TILING, ("grad_y", "x"))


def _check_message_ints(msg, ints):
    for req in ints:
        ok = False
        for alt in req:
            alt = alt if isinstance(alt, tuple) else (alt,)
            if all(contains_int(msg, v) for v in alt):
                ok = True
                break
        assert ok, f"message should contain one of {req!r}: {msg!r}"


@pytest.mark.parametrize("op,kw,mutate,code,names,ints", CASES)
def test_rule_rejected_nothing_written(gen, op, kw, mutate, code, names, ints):
    _, _, outs, build = OPS[op]
    d = build(gen, **kw)
    if mutate is not None:
        mutate(d, gen)
    for o in outs:
        poison(d[o])
    before = {k: snapshot(v) for k, v in d.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(moegrad.MoeError) as ei:
        call_c(op, d)
    err = ei.value
    assert isinstance(err, RuntimeError)
    assert err.code == code, f"expected code {code}, got {err.code}: {err}"
    msg = str(err)
    assert_names_one_of(msg, names)
    _check_message_ints(msg, ints)
    for k, snap in before.items():
        assert same_bytes(snapshot(d[k]), snap), f"{k} was modified by a failing call"


def test_moeerror_is_runtimeerror():
    assert issubclass(moegrad.MoeError, RuntimeError)


def test_case_table_covers_every_op():
    ops = {p.values[0] for p in CASES}
    assert ops == set(OPS)


# ------------------------------------------------------------------ valid calls succeed -----

def _run_valid(gen, op, kw, mutate=None):
    _, _, outs, build = OPS[op]
    d = build(gen, **kw)
    if mutate is not None:
        mutate(d, gen)
    for o in outs:
        poison(d[o])
    call_c(op, d)
    for o in outs:
        if d[o] is not None:
            assert_fully_written(d[o], o)
    return d


VALID = [
    # D4: zero rows are valid for all six operators.
    ("D4-gating_fwd-M0-sigmoid", "gating_fwd", dict(M=0), None),
    ("D4-gating_fwd-M0-softmax", "gating_fwd", dict(M=0, norm_type=0, out_flag=False), None),
    ("D4-gating_bwd-M0", "gating_bwd", dict(M=0), None),
    ("D4-fin_fwd-R0-scales", "fin_fwd", dict(R=0), None),
    ("D4-fin_fwd-R0-mode1", "fin_fwd", dict(R=0, mode=1), None),
    ("D4-fin_fwd-R0-no-scales", "fin_fwd",
     dict(R=0, K=1, scales=False, expert_idx=False, bias=False), None),
    ("D4-fin_grad-R0-mode0", "fin_grad", dict(R=0), None),
    ("D4-fin_grad-R0-mode0-no-scales", "fin_grad",
     dict(R=0, K=1, scales=False, bias=False, expert_idx=False), None),
    ("D4-swiglu_fwd-T0", "swiglu_fwd", dict(T=0), None),
    ("D4-swiglu_bwd-T0", "swiglu_bwd", dict(T=0), None),
    # D2: N = 1 in the forward; N = 2 (the minimum) in the backward.
    ("D2-gating_fwd-N1-sigmoid", "gating_fwd", dict(N=1, k=1, k_group=1, group_count=1), None),
    ("D2-gating_fwd-N1-softmax", "gating_fwd",
     dict(N=1, k=1, k_group=1, group_count=1, norm_type=0, bias=False), None),
    ("D2-gating_fwd-N1-sqrt-softplus", "gating_fwd",
     dict(N=1, k=1, k_group=1, group_count=1, norm_type=2), None),
    ("D2-gating_bwd-N2", "gating_bwd", dict(N=2, K=2), None),
    # k = N, N = 2048, every norm_type, renorm 1, negative eps / routed_scaling_factor (D13).
    ("D13-k-eq-N", "gating_fwd", dict(N=8, k=8, k_group=1, group_count=1), None),
    ("D13-N-2048", "gating_fwd", dict(M=2, N=2048, k=8, k_group=1, group_count=1), None),
    ("D13-grouped-mode1", "gating_fwd", dict(group_select_mode=1, k_group=2, group_count=4), None),
    ("D13-softmax-renorm1", "gating_fwd", dict(norm_type=0, renorm=1), None),
    ("D13-sqrt-softplus", "gating_fwd", dict(norm_type=2), None),
    ("D13-negative-eps-rsf", "gating_fwd", dict(eps=-0.25, rsf=-1.5), None),
    ("D13-gating_bwd-negative-rsf", "gating_bwd", dict(rsf=-2.5, eps=1e-10), None),
    ("gating_bwd-K-eq-N-2048", "gating_bwd", dict(M=2, N=2048, K=2048), None),
    ("gating_bwd-f16-grad", "gating_bwd", dict(dtype=F16), None),
    ("gating_bwd-bf16-grad", "gating_bwd", dict(dtype=BF16), None),
    # D1: repeated expert ids in a gating-backward row are summed, not rejected.
    ("D1-gating_bwd-duplicates", "gating_bwd", dict(M=3, N=8, K=3),
     lambda d, g: d["expert_idx"].__setitem__((slice(None), 1), d["expert_idx"][:, 0])),
    # D11: clamp_limit -1.0 (off) and any positive value.
    ("D11-swiglu_fwd-clamp-off", "swiglu_fwd", dict(clamp=-1.0), None),
    ("D11-swiglu_fwd-clamp-pos", "swiglu_fwd", dict(clamp=0.5), None),
    ("D11-swiglu_bwd-clamp-off", "swiglu_bwd", dict(clamp=-1.0), None),
    ("D11-swiglu_bwd-clamp-pos", "swiglu_bwd", dict(clamp=7.0), None),
    # D9: any weight shape with T elements.
    ("D9-swiglu_fwd-weight-T1", "swiglu_fwd", {}, reshape("weight", 6, 1)),
    ("D9-swiglu_fwd-weight-BS", "swiglu_fwd", dict(lead=(2, 3)), None),
    ("D9-swiglu_fwd-weight-flat-for-BS", "swiglu_fwd", dict(lead=(2, 3)), reshape("weight", 6)),
    ("D9-swiglu_bwd-weight-T1", "swiglu_bwd", {},
     chain(reshape("weight", 6, 1), reshape("grad_weight", 6, 1))),
    ("D9-swiglu_bwd-weight-BS", "swiglu_bwd", {},
     chain(reshape("weight", 2, 3), reshape("grad_weight", 2, 3))),
    # L7: the C gradWeight output stays optional even with a weight.
    ("L7-swiglu_bwd-no-grad_weight", "swiglu_bwd", dict(grad_weight=False), None),
    # L8: negative group_index entries are not rejected; an empty group_index is valid.
    ("L8-swiglu_fwd-negative-groups", "swiglu_fwd", {},
     lambda d, g: d.__setitem__("group_index", torch.tensor([4, -3, 2], dtype=I64))),
    ("L8-swiglu_bwd-negative-groups", "swiglu_bwd", {},
     lambda d, g: d.__setitem__("group_index", torch.tensor([-2, 9], dtype=I64))),
    ("swiglu_fwd-empty-group_index", "swiglu_fwd", {},
     lambda d, g: d.__setitem__("group_index", torch.zeros(0, dtype=I64))),
    ("swiglu_fwd-no-optionals", "swiglu_fwd", dict(weight=False, group_index=False), None),
    ("swiglu_bwd-y_origin-without-weight", "swiglu_bwd", dict(weight=False), None),
    ("swiglu_fwd-bf16", "swiglu_fwd", dict(dtype=BF16), None),
    ("swiglu_bwd-f16", "swiglu_bwd", dict(dtype=F16), None),
    # Finalize forward: all four modes, optionals absent, L4 ways of finding K, L5 truncation.
    ("fin_fwd-mode1", "fin_fwd", dict(mode=1), None),
    ("fin_fwd-mode2", "fin_fwd", dict(mode=2), None),
    ("fin_fwd-mode3", "fin_fwd", dict(mode=3), None),
    ("fin_fwd-only-required", "fin_fwd",
     dict(K=1, scales=False, bias=False, x1=False, x2=False, expert_idx=False), None),
    ("L4-fin_fwd-K-from-expert_idx", "fin_fwd", dict(scales=False, bias=False), None),
    ("L4-fin_fwd-K-from-numel", "fin_fwd",
     dict(K=3, scales=False, bias=False, expert_idx=False), None),
    ("L5-fin_fwd-truncated-expanded_x", "fin_fwd", {},
     lambda d, g: d.__setitem__("expanded_x", d["expanded_x"][:5].clone())),
    ("fin_fwd-bf16", "fin_fwd", dict(dtype=BF16), None),
    # D6: -1 may repeat in drop-pad; values >= active_num are skipped, not errors.
    ("D6-fin_fwd-mode1-many-drops", "fin_fwd", dict(mode=1),
     lambda d, g: d["expanded_row_idx"][:5].fill_(-1)),
    ("D6-fin_grad-mode1-many-drops", "fin_grad", dict(mode=1),
     lambda d, g: d["expanded_row_idx"][:5].fill_(-1)),
    ("D6-fin_grad-active_num", "fin_grad", dict(active_num=5), None),
    ("fin_grad-active_num-ge-RK-ignored", "fin_grad", {}, attr("active_num", 11)),
    ("fin_grad-mode1", "fin_grad", dict(mode=1), None),
    ("fin_grad-no-bias", "fin_grad", dict(bias=False, expert_idx=False), None),
    ("D5-fin_grad-no-scales", "fin_grad", dict(K=1, scales=False, bias=False, expert_idx=False),
     None),
    # L6: without scales expanded_x is neither read nor checked.
    ("L6-fin_grad-no-scales-bad-expanded_x", "fin_grad",
     dict(K=1, scales=False, bias=False, expert_idx=False),
     lambda d, g: d.__setitem__("expanded_x", torch.zeros(3, 5, 7, dtype=F64))),
]


@pytest.mark.parametrize("op,kw,mutate", [pytest.param(*v[1:], id=v[0]) for v in VALID])
def test_valid_call_accepted_and_fully_written(gen, op, kw, mutate):
    _run_valid(gen, op, kw, mutate)


def test_D4_drop_pad_grad_zero_rows_zero_fills(gen):
    d = _run_valid(gen, "fin_grad", dict(R=0, mode=1), None)
    assert d["grad_expanded_x"].shape == (3, 4, 8)
    assert torch.equal(d["grad_expanded_x"], torch.zeros(3, 4, 8))


def test_D2_gating_fwd_N1_values(gen):
    x = randn(gen, 5, 1)
    for norm_type in (0, 1, 2):
        y, idx, norm_out = moegrad.moe_gating_top_k(x, 1, norm_type=norm_type, out_flag=True,
                                                    routed_scaling_factor=2.0)
        assert y.shape == (5, 1) and idx.shape == (5, 1) and norm_out.shape == (5, 1)
        assert torch.equal(idx, torch.zeros(5, 1, dtype=I32))
        # One expert: the (re)normalised weight is 1 (eps = 1e-20 vanishes in fp32), times rsf.
        torch.testing.assert_close(y, torch.full((5, 1), 2.0), rtol=1e-6, atol=0)
        x64 = x.double()
        ref = {0: torch.ones_like(x64), 1: torch.sigmoid(x64),
               2: torch.sqrt(torch.nn.functional.softplus(x64))}[norm_type]
        torch.testing.assert_close(norm_out.double(), ref, rtol=1e-6, atol=1e-7)


def test_D2_gating_autograd_N1_reports_backward_rule(gen):
    x = randn(gen, 4, 1).requires_grad_()
    y, _, _ = moegrad.moe_gating_top_k(x, 1, norm_type=1)
    with pytest.raises(moegrad.MoeError) as ei:
        (y * upstream(gen, 4, 1)).sum().backward()
    assert ei.value.code == PARAM_INVALID
    assert_names_one_of(str(ei.value), ("x_norm", "x"))


def test_D1_duplicates_are_summed(gen):
    """Repeated ids in a backward row: scatter-add of the per-slot terms (D1)."""
    M, N, K = 3, 8, 3
    x_norm = rand(gen, M, N, lo=0.05, hi=0.95)
    gy = upstream(gen, M, K)
    idx = torch.tensor([[2, 2, 5], [0, 7, 0], [4, 4, 4]], dtype=I32)
    gx = moegrad.moe_gating_top_k_backward(x_norm, gy, idx, routed_scaling_factor=1.5, eps=1e-20)
    xn, g64 = x_norm.double(), gy.double() * 1.5
    w_raw = xn.gather(1, idx.long())
    D = w_raw.sum(1, keepdim=True) + 1e-20
    beta = (w_raw / D * g64).sum(1, keepdim=True)
    gp = (g64 - beta) / D
    G = torch.zeros(M, N, dtype=F64).scatter_add_(1, idx.long(), gp)
    ref = xn * (1 - xn) * G
    torch.testing.assert_close(gx.double(), ref, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------- public API, same codes ---

def _gating_x(g, M=4, N=16):
    return randn(g, M, N)


def _perm(g, n, dtype=I32):
    return torch.randperm(n, generator=g).to(dtype)


def _rows_idx(g, M, N, K, dtype=I32):
    return _rows_unique_idx(g, M, N, K, dtype)


PUBLIC = [
    # gating forward
    ("gating-k0", lambda g: moegrad.moe_gating_top_k(_gating_x(g), 0, norm_type=1), TILING, "k"),
    ("gating-k-gt-N", lambda g: moegrad.moe_gating_top_k(_gating_x(g), 17), TILING, "k"),
    ("gating-x-f64", lambda g: moegrad.moe_gating_top_k(_gating_x(g).double(), 2), PARAM_INVALID,
     "x"),
    ("gating-bias-len", lambda g: moegrad.moe_gating_top_k(_gating_x(g), 2, bias=randn(g, 15)),
     TILING, "bias"),
    ("gating-norm_type-5", lambda g: moegrad.moe_gating_top_k(_gating_x(g), 2, norm_type=5),
     TILING, "norm_type"),
    ("gating-eps-nan", lambda g: moegrad.moe_gating_top_k(_gating_x(g), 2, eps=NAN), TILING,
     "eps"),
    ("gating-group_count-3", lambda g: moegrad.moe_gating_top_k(_gating_x(g), 2, group_count=3),
     TILING, "group_count"),
    ("gating-x-rank3", lambda g: moegrad.moe_gating_top_k(randn(g, 2, 4, 16), 2), TILING, "x"),
    # gating backward
    ("gating_bwd-norm_type-3", lambda g: moegrad.moe_gating_top_k_backward(
        rand(g, 4, 16), upstream(g, 4, 2), _rows_idx(g, 4, 16, 2), norm_type=3),
     PARAM_INVALID, "norm_type"),
    ("gating_bwd-softmax-renorm-2", lambda g: moegrad.moe_gating_top_k_backward(
        rand(g, 4, 16), upstream(g, 4, 2), _rows_idx(g, 4, 16, 2), renorm=2, norm_type=0),
     PARAM_INVALID, "renorm"),
    ("gating_bwd-N1", lambda g: moegrad.moe_gating_top_k_backward(
        rand(g, 4, 1), upstream(g, 4, 1), torch.zeros(4, 1, dtype=I32)),
     PARAM_INVALID, "x_norm"),
    ("gating_bwd-x_norm-f16", lambda g: moegrad.moe_gating_top_k_backward(
        rand(g, 4, 16, dtype=F16), upstream(g, 4, 2), _rows_idx(g, 4, 16, 2)),
     PARAM_INVALID, "x_norm"),
    ("gating_bwd-idx-out-of-range-int64", lambda g: moegrad.moe_gating_top_k_backward(
        rand(g, 4, 16), upstream(g, 4, 2),
        torch.tensor([[1, 2], [3, 4], [5, 16], [0, 9]], dtype=I64)),
     PARAM_INVALID, "expert_idx"),
    ("gating_bwd-idx-int64-wraps-to-valid", lambda g: moegrad.moe_gating_top_k_backward(
        rand(g, 4, 16), upstream(g, 4, 2),
        torch.tensor([[1, 2], [3, 4], [5, (1 << 32) + 6], [0, 9]], dtype=I64)),
     PARAM_INVALID, "expert_idx"),
    ("gating_bwd-idx-float", lambda g: moegrad.moe_gating_top_k_backward(
        rand(g, 4, 16), upstream(g, 4, 2), _rows_idx(g, 4, 16, 2).float()),
     PARAM_INVALID, "expert_idx"),
    ("gating_bwd-eps-inf", lambda g: moegrad.moe_gating_top_k_backward(
        rand(g, 4, 16), upstream(g, 4, 2), _rows_idx(g, 4, 16, 2), eps=INF),
     PARAM_INVALID, "eps"),
    # finalize forward
    ("fin-drop_pad_mode-4", lambda g: moegrad.moe_finalize_routing(
        randn(g, 8, 8), _perm(g, 8), scales=rand(g, 4, 2), drop_pad_mode=4),
     FINALIZE, "drop_pad_mode"),
    ("fin-idx-duplicate", lambda g: moegrad.moe_finalize_routing(
        randn(g, 8, 8), torch.tensor([0, 1, 2, 3, 4, 5, 6, 6], dtype=I32), scales=rand(g, 4, 2)),
     FINALIZE, "expanded_row_idx"),
    ("fin-idx-out-of-range-int64", lambda g: moegrad.moe_finalize_routing(
        randn(g, 8, 8), torch.tensor([0, 1, 2, 3, 4, 5, 6, 8], dtype=I64), scales=rand(g, 4, 2)),
     FINALIZE, "expanded_row_idx"),
    ("fin-idx-int64-wraps-to-valid", lambda g: moegrad.moe_finalize_routing(
        randn(g, 8, 8), torch.tensor([0, 1, 2, 3, 4, 5, 6, (1 << 32) + 7], dtype=I64),
        scales=rand(g, 4, 2)),
     FINALIZE, "expanded_row_idx"),
    ("fin-idx-float", lambda g: moegrad.moe_finalize_routing(
        randn(g, 8, 8), _perm(g, 8).float(), scales=rand(g, 4, 2)),
     PARAM_INVALID, "expanded_row_idx"),
    ("fin-idx-int16", lambda g: moegrad.moe_finalize_routing(
        randn(g, 8, 8), _perm(g, 8).to(torch.int16), scales=rand(g, 4, 2)),
     PARAM_INVALID, "expanded_row_idx"),
    ("fin-k-0", lambda g: moegrad.moe_finalize_routing(randn(g, 8, 8), _perm(g, 8), k=0),
     FINALIZE, "k"),
    ("fin-k-neg", lambda g: moegrad.moe_finalize_routing(randn(g, 8, 8), _perm(g, 8), k=-2),
     FINALIZE, "k"),
    ("L4-fin-len-not-multiple-of-k", lambda g: moegrad.moe_finalize_routing(
        randn(g, 7, 8), _perm(g, 7), k=2),
     FINALIZE, ("k", "expanded_row_idx")),
    ("fin-x2-without-x1", lambda g: moegrad.moe_finalize_routing(
        randn(g, 8, 8), _perm(g, 8), x2=randn(g, 4, 8), scales=rand(g, 4, 2)),
     FINALIZE, ("x2", "x1")),
    ("fin-bias-without-expert_idx", lambda g: moegrad.moe_finalize_routing(
        randn(g, 8, 8), _perm(g, 8), bias=randn(g, 3, 8), scales=rand(g, 4, 2)),
     FINALIZE, ("bias", "expert_idx")),
    ("fin-expert_idx-int64-out-of-range", lambda g: moegrad.moe_finalize_routing(
        randn(g, 8, 8), _perm(g, 8), bias=randn(g, 3, 8), scales=rand(g, 4, 2),
        expert_idx=torch.tensor([[0, 1], [2, 3], [1, 1], [0, 0]], dtype=I64)),
     FINALIZE, "expert_idx"),
    # finalize grad
    ("fin_grad-mode1-expert_num-0", lambda g: moegrad.moe_finalize_routing_grad(
        upstream(g, 4, 8), _perm(g, 8), randn(g, 3, 4, 8), rand(g, 4, 2), drop_pad_mode=1,
        expert_num=0, expert_capacity=4),
     FINALIZE, "expert_num"),
    ("fin_grad-mode2", lambda g: moegrad.moe_finalize_routing_grad(
        upstream(g, 4, 8), _perm(g, 8), randn(g, 8, 8), rand(g, 4, 2), drop_pad_mode=2),
     FINALIZE, "drop_pad_mode"),
    ("fin_grad-duplicate", lambda g: moegrad.moe_finalize_routing_grad(
        upstream(g, 4, 8), torch.tensor([5, 1, 2, 3, 4, 5, 6, 7], dtype=I64), randn(g, 8, 8),
        rand(g, 4, 2)),
     FINALIZE, "expanded_row_idx"),
    ("fin_grad-scales-without-expanded_x", lambda g: moegrad.moe_finalize_routing_grad(
        upstream(g, 4, 8), _perm(g, 8), None, rand(g, 4, 2)),
     FINALIZE, "expanded_x"),
    ("fin_grad-no-scales-K2", lambda g: moegrad.moe_finalize_routing_grad(
        upstream(g, 4, 8), _perm(g, 8), randn(g, 8, 8)),
     FINALIZE, ("grad_y", "expanded_row_idx")),
    ("fin_grad-grad_y-f64", lambda g: moegrad.moe_finalize_routing_grad(
        upstream(g, 4, 8).double(), _perm(g, 4)),
     PARAM_INVALID, "grad_y"),
    # SwiGLU forward
    ("swiglu-clamp-0", lambda g: moegrad.swiglu_group(randn(g, 6, 16), clamp_limit=0.0),
     TILING, "clamp_limit"),
    ("swiglu-clamp-nan", lambda g: moegrad.swiglu_group(randn(g, 6, 16), clamp_limit=NAN),
     TILING, "clamp_limit"),
    ("swiglu-x-odd", lambda g: moegrad.swiglu_group(randn(g, 6, 15)), TILING, "x"),
    ("swiglu-weight-numel", lambda g: moegrad.swiglu_group(randn(g, 6, 16), weight=rand(g, 5)),
     TILING, "weight"),
    ("swiglu-weight-f16", lambda g: moegrad.swiglu_group(randn(g, 6, 16),
                                                         weight=rand(g, 6, dtype=F16)),
     PARAM_INVALID, "weight"),
    ("swiglu-group_index-rank2", lambda g: moegrad.swiglu_group(
        randn(g, 6, 16), group_index=torch.ones(2, 2, dtype=I64)), TILING, "group_index"),
    # SwiGLU backward
    ("swiglu_bwd-weight-without-y_origin", lambda g: moegrad.swiglu_group_quant_backward(
        upstream(g, 6, 8), randn(g, 6, 16), weight=rand(g, 6)),
     TILING, ("y_origin", "weight")),
    ("swiglu_bwd-clamp-neg", lambda g: moegrad.swiglu_group_quant_backward(
        upstream(g, 6, 8), randn(g, 6, 16), clamp_limit=-0.5),
     TILING, "clamp_limit"),
    ("swiglu_bwd-dtype-mismatch", lambda g: moegrad.swiglu_group_quant_backward(
        upstream(g, 6, 8, dtype=F16), randn(g, 6, 16)),
     PARAM_INVALID, ("grad_y", "x")),
    ("swiglu_bwd-grad_y-last-dim", lambda g: moegrad.swiglu_group_quant_backward(
        upstream(g, 6, 9), randn(g, 6, 16)),
     TILING, ("grad_y", "x")),
]


@pytest.mark.parametrize("fn,code,names", [pytest.param(*p[1:], id=p[0]) for p in PUBLIC])
def test_public_api_same_code(gen, fn, code, names):
    with pytest.raises(moegrad.MoeError) as ei:
        fn(gen)
    assert ei.value.code == code, f"expected {code}, got {ei.value.code}: {ei.value}"
    assert_names_one_of(str(ei.value), names)


def test_public_ops_namespace_same_code(gen):
    """torch.ops.moegrad.* and moegrad.ops.* raise MoeError with the same code too."""
    from moegrad.ops import moe_gating_top_k
    x = randn(gen, 4, 16)
    with pytest.raises(moegrad.MoeError) as ei:
        moe_gating_top_k(x, 0)
    assert ei.value.code == TILING
    with pytest.raises(moegrad.MoeError) as ei2:
        torch.ops.moegrad.swiglu_group(randn(gen, 6, 16), None, None, 0.0)
    assert ei2.value.code == TILING
    assert_names_one_of(str(ei2.value), "clamp_limit")


# ----------------------------------------------------------------------- D4 via the public API --

def test_D4_zero_rows_public_api(gen):
    H = 8
    y, idx, no = moegrad.moe_gating_top_k(randn(gen, 0, 16), 4, k_group=2, group_count=4,
                                          norm_type=1, out_flag=True)
    assert y.shape == (0, 4) and idx.shape == (0, 4) and no.shape == (0, 16)
    assert idx.dtype == I32 and no.dtype == F32
    gx = moegrad.moe_gating_top_k_backward(rand(gen, 0, 16), upstream(gen, 0, 4),
                                           torch.zeros(0, 4, dtype=I32))
    assert gx.shape == (0, 16)
    out = moegrad.moe_finalize_routing(randn(gen, 0, H), torch.zeros(0, dtype=I32), k=2)
    assert out.shape == (0, H)
    out = moegrad.moe_finalize_routing(randn(gen, 0, H), torch.zeros(0, dtype=I32),
                                       scales=rand(gen, 0, 2))
    assert out.shape == (0, H)
    gex, gs = moegrad.moe_finalize_routing_grad(upstream(gen, 0, H), torch.zeros(0, dtype=I32),
                                                randn(gen, 0, H), rand(gen, 0, 2))
    # scales (0, 2) has no elements: absent, so grad_scales is (R, 1) (docs/operators.md §3)
    assert gex.shape == (0, H) and gs.shape == (0, 1)
    gex, gs = moegrad.moe_finalize_routing_grad(upstream(gen, 0, H), torch.zeros(0, dtype=I32),
                                                randn(gen, 3, 4, H), rand(gen, 0, 2),
                                                drop_pad_mode=1, expert_num=3, expert_capacity=4)
    assert gex.shape == (3, 4, H) and torch.equal(gex, torch.zeros(3, 4, H))
    y = moegrad.swiglu_group(randn(gen, 0, 2 * H), weight=rand(gen, 0))
    assert y.shape == (0, H)
    gx, gw = moegrad.swiglu_group_quant_backward(upstream(gen, 0, H), randn(gen, 0, 2 * H),
                                                 weight=rand(gen, 0), y_origin=randn(gen, 0, H))
    assert gx.shape == (0, 2 * H) and gw.shape == (0,) and gw.dtype == F32


def test_D4_zero_rows_autograd(gen):
    """Zero tokens also flow through the autograd paths (a rank with no tokens still trains)."""
    H = 8
    x = randn(gen, 0, 16).requires_grad_()
    y, _, _ = moegrad.moe_gating_top_k(x, 4, norm_type=1)
    y.sum().backward()
    assert x.grad.shape == (0, 16)
    ex = randn(gen, 0, H).requires_grad_()
    sc = rand(gen, 0, 2).requires_grad_()
    out = moegrad.moe_finalize_routing(ex, torch.zeros(0, dtype=I32), scales=sc)
    out.sum().backward()
    assert ex.grad.shape == (0, H)
    # §7.3: a tensor with numel 0 counts as absent, so empty scales may get a None gradient.
    assert sc.grad is None or sc.grad.shape == (0, 2)
    xs = randn(gen, 0, 2 * H).requires_grad_()
    moegrad.swiglu_group(xs).sum().backward()
    assert xs.grad.shape == (0, 2 * H)


def test_clamp_limit_minus_one_exactly_is_off(gen):
    """-1.0 is the 'off' sentinel (D11): result equals the unclamped formula even for big x."""
    x = randn(gen, 6, 16, scale=4.0)
    y = moegrad.swiglu_group(x, clamp_limit=-1.0)
    x64 = x.double()
    ref = torch.nn.functional.silu(x64[:, :8]) * x64[:, 8:]
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6)


# ---------------------------------------------- the value as the caller gave it (L153, L154) --

def _message(fn, code, *args, **kwargs):
    with pytest.raises(moegrad.MoeError) as ei:
        fn(*args, **kwargs)
    assert ei.value.code == code, str(ei.value)
    return str(ei.value)


@pytest.mark.parametrize("dst,kind", [(290, "HiFloat8"), (296, "float4_e2m1"),
                                      (297, "float4_e1m2"), (34, "HiFloat8"), (7, "must be")])
def test_dst_type_reported_as_given(gen, dst, kind):
    """Vendor codes reach the native validator unchanged: 290 is reported as 290, not as the
    aclDataType 34 it maps to, with the accepted codes in the same (Python) vocabulary."""
    for fn in (moegrad.swiglu_group_quant, torch.ops.moegrad.swiglu_group_quant):
        msg = _message(fn, 161002, randn(gen, 4, 256), dst_type=dst)
        assert msg.startswith("swiglu_group_quant: dst_type: ") and kind in msg, msg
        assert msg.endswith(f"; got {dst}"), msg
        assert "292" in msg and "291" in msg, msg  # torch_npu codes of the two FP8 types


def test_dst_type_not_an_integer_is_reported_not_truncated(gen):
    msg = _message(moegrad.swiglu_group_quant, 161002, randn(gen, 4, 256), dst_type=290.5)
    assert "dst_type" in msg and msg.endswith("got 290.5"), msg


@pytest.mark.parametrize("limit,text", [(-0.9999999, "-0.9999999"), (1e-50, "1e-50"),
                                        (-0.1234567891, "-0.1234567891")])
def test_float_attribute_reported_as_given(gen, limit, text):
    """Doubles print in their shortest exact form: -0.9999999 is not reported as -1."""
    for fn, x in ((moegrad.swiglu_group, randn(gen, 4, 16)),
                  (moegrad.swiglu_group_quant, randn(gen, 4, 256))):
        msg = _message(fn, 561002, x, clamp_limit=limit)
        assert "clamp_limit" in msg and msg.endswith("got " + text), msg


def test_gating_attributes_reported_as_given(gen):
    msg = _message(moegrad.moe_gating_top_k, 561002, randn(gen, 4, 8), 2,
                   routed_scaling_factor=float("-inf"))
    assert msg.endswith("routed_scaling_factor: must be finite; got -inf"), msg


@pytest.mark.parametrize("rng,code,got", [([1, 5], 561103, "[1, 5]"),
                                          ([0, 1, 2], 561103, "[0, 1, 2]"),
                                          ([1.5, 3], 161002, "[1.5, 3]")])
def test_active_expert_range_reported_as_given(gen, rng, code, got):
    msg = _message(moegrad.moe_init_routing, code, randn(gen, 4, 8),
                   torch.zeros(4, 2, dtype=I32), expert_num=4, active_expert_range=rng)
    assert "active_expert_range" in msg and msg.endswith("got " + got), msg


def test_int64_index_value_reported_unnarrowed(gen):
    """An int64 expert id past the int32 range is reported with its own value."""
    eidx = torch.zeros(4, 2, dtype=torch.int64)
    eidx[2, 1] = 2 ** 40
    msg = _message(moegrad.moe_init_routing, 561103, randn(gen, 4, 8), eidx, expert_num=4)
    assert "expert_idx" in msg and contains_int(msg, 2 ** 40), msg
