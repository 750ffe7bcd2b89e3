"""moe_init_routing / moe_init_routing_grad (docs/operators.md §8; decisions D25-D31, L30-L39).

Numbers against the independent float64 reference (reference.py) and the worked example of
§8.12; every validation rule with its status code and nothing written on failure; autograd,
opcheck and the init routing -> SwiGLU -> finalize routing chain.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import moegrad
from moegrad import _C

import reference as ref
from conftest import DTYPES, DTYPE_IDS, assert_close_to_ref, poison, randn, rand_expert_idx
from _util_validation import assert_names_one_of, snapshot

ERR_NULL, ERR_PARAM, ERR_SHAPE = 161001, 161002, 561103

# --------------------------------------------------------------------------- worked example --
X = torch.tensor([[0.1, 0.2], [1.1, 1.2], [2.1, 2.2]])
EIDX = torch.tensor([[3, 1], [1, 0], [3, 2]], dtype=torch.int32)
ROWS = {"x0": X[0], "x1": X[1], "x2": X[2], "0": torch.zeros(2)}


def _rows(names):
    return torch.stack([ROWS[n] for n in names])


WORKED = [
    # kwargs, expanded_row_idx, expanded_x rows (flattened over E, C), counts
    (dict(expert_num=4), [4, 1, 2, 0, 5, 3], "x1 x0 x1 x2 x0 x2", [1, 2, 1, 2]),
    (dict(expert_num=4, expert_tokens_num_type=0), [4, 1, 2, 0, 5, 3], "x1 x0 x1 x2 x0 x2",
     [1, 3, 4, 6]),
    (dict(expert_num=4, active_num=4), [4, 1, 2, 0, 5, 3], "x1 x0 x1 x2", [1, 2, 1, 2]),
    (dict(expert_num=4, drop_pad_mode=1, expert_capacity=1), [3, 1, -1, 0, -1, 2],
     "x1 x0 x2 x0", [1, 2, 1, 2]),
    (dict(expert_num=4, drop_pad_mode=1, expert_capacity=2), [6, 2, 3, 0, 7, 4],
     "x1 0 x0 x1 x2 0 x0 x2", [1, 2, 1, 2]),
    (dict(expert_num=4, row_idx_type=1), [3, 1, 2, 5, 0, 4], "x1 x0 x1 x2 x0 x2", [1, 2, 1, 2]),
    (dict(expert_num=4, active_expert_range=[1, 3]), [-1, 0, 1, -1, -1, 2], "x0 x1 x2 0 0 0",
     [2, 1]),
    (dict(expert_num=4, active_expert_range=[1, 3], expert_tokens_num_type=0),
     [-1, 0, 1, -1, -1, 2], "x0 x1 x2 0 0 0", [2, 3]),
    (dict(expert_num=4, active_expert_range=[1, 3], expert_tokens_num_type=2),
     [-1, 0, 1, -1, -1, 2], "x0 x1 x2 0 0 0", [[1, 2], [2, 1], [0, 0], [0, 0]]),
    # rowIdxType 1 with a partial window: the tail follows the reference order (0, 4, 3).
    (dict(expert_num=4, active_expert_range=[1, 3], row_idx_type=1), [1, 2, 5, 0, 4, 3],
     "x0 x1 x2 0 0 0", [2, 1]),
]


@pytest.mark.parametrize("kw,idx,rows,counts", WORKED)
def test_worked_example_forward(kw, idx, rows, counts):
    for impl in ("lib", "ref"):
        if impl == "lib":
            ex, i, c = moegrad.moe_init_routing(X, EIDX, **kw)
            ex, i, c = ex.double(), i.tolist(), c.tolist()
        else:
            ex, i, c = ref.moe_init_routing(X, EIDX, **kw)
            ex, i, c = torch.from_numpy(ex), i.tolist(), c.tolist()
        assert i == idx, impl
        assert torch.equal(ex.reshape(-1, 2).float(), _rows(rows.split())), impl
        assert c == counts, impl


G = torch.arange(1, 13, dtype=torch.float32).reshape(6, 2)
D8 = torch.arange(1, 17, dtype=torch.float32).reshape(4, 2, 2)
WORKED_GRAD = [
    (G, [4, 1, 2, 0, 5, 3], 0, 0, [[12, 14], [6, 8], [18, 20]]),
    (G[:4], [4, 1, 2, 0, 5, 3], 0, 4, [[3, 4], [6, 8], [7, 8]]),
    (G[:4].reshape(4, 1, 2), [3, 1, -1, 0, -1, 2], 1, 0, [[10, 12], [1, 2], [5, 6]]),
    (D8, [6, 2, 3, 0, 7, 4], 1, 0, [[18, 20], [8, 10], [24, 26]]),
]


@pytest.mark.parametrize("g,idx,mode,active,want", WORKED_GRAD)
def test_worked_example_grad(g, idx, mode, active, want):
    i = torch.tensor(idx, dtype=torch.int32)
    out = moegrad.moe_init_routing_grad(g, i, 2, mode, active)
    assert out.tolist() == want
    assert ref.moe_init_routing_grad(g, i, 2, mode, active).tolist() == want


def test_worked_example_adjoint_and_finalize():
    ex, idx, _ = moegrad.moe_init_routing(X, EIDX, expert_num=4)
    gx = moegrad.moe_init_routing_grad(G, idx, 2)
    assert float((G.double() * ex.double()).sum()) == pytest.approx(102.0, abs=1e-5)
    assert float((gx.double() * X.double()).sum()) == pytest.approx(102.0, abs=1e-5)
    scales = torch.tensor([[0.5, 0.25], [1.0, 2.0], [0.75, 0.125]])
    y = moegrad.moe_finalize_routing(ex, idx, scales=scales, drop_pad_mode=2)
    want = torch.tensor([[0.075, 0.15], [3.3, 3.6], [1.8375, 1.925]])
    assert torch.allclose(y, want, atol=1e-6)


# ------------------------------------------------------------------------- random vs ref --
CASES = [
    # R, K, E, H, kwargs
    (37, 3, 8, 17, {}),
    (64, 6, 64, 33, {}),
    (50, 2, 5, 8, dict(active_num=31)),
    (50, 2, 5, 8, dict(active_num=1000)),
    (40, 4, 8, 9, dict(drop_pad_mode=1, expert_capacity=7)),
    (40, 4, 8, 9, dict(drop_pad_mode=1, expert_capacity=100)),  # C > R (D30)
    (45, 3, 12, 5, dict(active_expert_range=[3, 9])),
    (45, 3, 12, 5, dict(active_expert_range=[0, 1], expert_tokens_num_type=2)),
    (45, 3, 12, 5, dict(active_expert_range=[4, 12], row_idx_type=1)),
    (30, 1, 2, 3, dict(expert_tokens_num_type=0)),                          # K = 1, E = 2
    (20, 4, 4, 7, dict(expert_tokens_num_type=2)),                          # K = E
    (3000, 8, 2048, 3, {}),                                                 # many experts
    (0, 2, 4, 5, {}),                                                       # zero tokens (D4)
    (0, 2, 4, 5, dict(drop_pad_mode=1, expert_capacity=3)),
    (0, 2, 4, 5, dict(active_expert_range=[1, 2], expert_tokens_num_type=2)),
    (25, 2, 0, 6, {}),                                                      # E unknown
    (6000, 3, 16, 2, dict(active_num=10000)),                               # several chunks
]


def _run_checked(x, eidx, kw):
    ex, idx, tok = moegrad.moe_init_routing(x, eidx, **kw)
    rex, ridx, rtok = ref.moe_init_routing(x, eidx, **kw)
    assert ex.dtype == x.dtype and idx.dtype == torch.int32 and tok.dtype == torch.int64
    assert idx.tolist() == ridx.tolist()
    assert tok.tolist() == rtok.tolist()
    # Bit copies of x rows (and +0.0 padding), so the comparison is exact.
    assert tuple(ex.shape) == rex.shape
    assert torch.equal(ex.double(), torch.from_numpy(rex))
    assert not torch.signbit(ex[ex == 0]).any(), "padding rows must be +0.0"
    return ex, idx, tok


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("R,K,E,H,kw", CASES)
def test_forward_matches_reference(R, K, E, H, kw, dtype, rng):
    x = randn((R, H), dtype, rng)
    eidx = rand_expert_idx(R, K, max(E, K), rng, distinct=True) if E else \
        torch.from_numpy(rng.integers(0, 1000, (R, K))).to(torch.int32)
    _run_checked(x, eidx, dict(kw, expert_num=E))


def test_forward_non_distinct_and_int64_ids(rng):
    x = randn((33, 4), torch.float32, rng)
    eidx = rand_expert_idx(33, 5, 3, rng, dtype=torch.int64, distinct=False)
    _run_checked(x, eidx, dict(expert_num=3, expert_tokens_num_type=0))
    _run_checked(x, eidx, dict(expert_num=3, drop_pad_mode=1, expert_capacity=4))


def test_sparse_ids_without_expert_num(rng):
    # Ids far apart (no E given) take the comparison-sort path; order must not change.
    x = randn((40, 3), torch.float32, rng)
    eidx = torch.from_numpy(rng.integers(0, 2**30, (40, 2))).to(torch.int32)
    eidx[5, 0] = eidx[17, 1]  # a tie between tokens
    _run_checked(x, eidx, {})
    _run_checked(x, eidx, dict(row_idx_type=1))


def test_thread_count_does_not_change_results(rng):
    x = randn((5000, 8), torch.bfloat16, rng)
    eidx = rand_expert_idx(5000, 4, 32, rng)
    outs = []
    for n in (1, 2, 3):
        old = _C.get_num_threads()
        _C.set_num_threads(n)
        try:
            outs.append(moegrad.moe_init_routing(x, eidx, expert_num=32,
                                                 drop_pad_mode=1, expert_capacity=600))
            g = randn((32, 600, 8), torch.bfloat16, np.random.default_rng(1))
            outs.append((moegrad.moe_init_routing_grad(g, outs[-1][1], 4, 1),))
        finally:
            _C.set_num_threads(old)
    for a, b in zip(outs[0] + outs[1], outs[2] + outs[3]):
        assert torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                           b.view(torch.uint8) if b.is_floating_point() else b)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("R,K,E,H,kw", [
    (37, 3, 8, 17, {}), (50, 2, 5, 8, dict(active_num=31)),
    (40, 4, 8, 9, dict(drop_pad_mode=1, expert_capacity=7)),
    (45, 3, 12, 2049, dict(active_expert_range=[3, 9])), (30, 1, 2, 3, {}), (0, 2, 4, 5, {}),
    (0, 2, 4, 5, dict(drop_pad_mode=1, expert_capacity=3)),
])
def test_grad_matches_reference(R, K, E, H, kw, dtype, rng):
    x = randn((R, H), dtype, rng)
    eidx = rand_expert_idx(R, K, E, rng)
    ex, idx, _ = moegrad.moe_init_routing(x, eidx, expert_num=E, **kw)
    g = randn(tuple(ex.shape), dtype, rng)
    mode = kw.get("drop_pad_mode", 0)
    active = kw.get("active_num", 0)
    out = moegrad.moe_init_routing_grad(g, idx, K, mode, active)
    want = ref.moe_init_routing_grad(g, idx, K, mode, active)
    scale = ref.moe_init_routing_grad(g.abs(), idx, K, mode, active)
    assert_close_to_ref(out, want, scale=scale, n_reduce=K, what="grad_x")


def test_low_level_outputs_fully_written(rng):
    """Poisoned output buffers: every element is written (zero rows, -1, counts, kv tail)."""
    x = randn((20, 5), torch.float32, rng)
    eidx = rand_expert_idx(20, 3, 8, rng)
    for kw in (dict(drop_pad_mode=0, active_num=0, rng=None),
               dict(drop_pad_mode=1, active_num=0, rng=None),
               dict(drop_pad_mode=0, active_num=0, rng=(2, 5))):
        mode, rg = kw["drop_pad_mode"], kw["rng"]
        attrs = (0, 9, 8, mode, 2, True, rg is not None, *(rg or (0, 0)), 0)
        sx, si, st = _C.infer_moe_init_routing(x, eidx, *attrs)
        ex = poison(torch.empty(sx))
        idx = poison(torch.empty(si, dtype=torch.int32))
        tok = poison(torch.empty(st, dtype=torch.int64))
        _C.moe_init_routing(x, eidx, *attrs, ex, idx, tok)
        rex, ridx, rtok = ref.moe_init_routing(
            x, eidx, expert_capacity=9, expert_num=8, drop_pad_mode=mode,
            expert_tokens_num_type=2, active_expert_range=list(rg) if rg else None)
        assert torch.equal(ex.double(), torch.from_numpy(rex))
        assert idx.tolist() == ridx.tolist() and tok.tolist() == rtok.tolist()
    g = poison(torch.empty(7, 5))
    (so,) = _C.infer_moe_init_routing_grad(torch.ones(9, 5), torch.full((9,), -1, dtype=torch.int32),
                                           3, 0, 0)
    out = poison(torch.empty(so))
    _C.moe_init_routing_grad(torch.ones(9, 5), torch.full((9,), -1, dtype=torch.int32), 3, 0, 0,
                             out)
    assert torch.equal(out, torch.zeros(3, 5)) and g.isnan().all()


@pytest.mark.parametrize("mode", [0, 1])
def test_large_outputs_take_the_streaming_copy(mode, rng):
    """expanded_x of >= 8 MB is written with non-temporal stores, smaller ones with plain
    copies (L87): the large path, with odd H (rows not vector-aligned) and zero padding rows,
    into a poisoned buffer, equals the reference bit for bit."""
    R, K, E, H, cap = 2100, 2, 16, 1001, 300
    x = randn((R, H), torch.float32, rng)
    eidx = rand_expert_idx(R, K, E, rng)
    attrs = (0, cap, E, mode, 1, True, False, 0, 0, 0)
    sx, si, st = _C.infer_moe_init_routing(x, eidx, *attrs)
    assert math.prod(sx) * 4 >= 8 << 20
    ex = poison(torch.empty(sx))
    idx = poison(torch.empty(si, dtype=torch.int32))
    tok = poison(torch.empty(st, dtype=torch.int64))
    _C.moe_init_routing(x, eidx, *attrs, ex, idx, tok)
    rex, ridx, rtok = ref.moe_init_routing(x, eidx, expert_capacity=cap, expert_num=E,
                                           drop_pad_mode=mode)
    assert torch.equal(ex.double(), torch.from_numpy(rex))
    assert idx.tolist() == ridx.tolist() and tok.tolist() == rtok.tolist()
    if mode == 1:
        assert (torch.from_numpy(rex) == 0).all(-1).any(), "the case must have padding rows"


# ------------------------------------------------------------------------------ validation --
def _fwd_args(**over):
    a = dict(x=torch.randn(6, 4), eidx=torch.tensor([[0, 1]] * 6, dtype=torch.int32),
             active_num=0, cap=0, E=4, mode=0, ttype=1, flag=True, has_range=False, start=0,
             end=0, rit=0)
    a.update(over)
    return a


def _fwd_call(a, outs=None):
    attrs = (a["active_num"], a["cap"], a["E"], a["mode"], a["ttype"], a["flag"],
             a["has_range"], a["start"], a["end"], a["rit"])
    if outs is None:
        return _C.moe_init_routing(a["x"], a["eidx"], *attrs, *_good_outs(a))
    return _C.moe_init_routing(a["x"], a["eidx"], *attrs, *outs)


def _good_outs(a):
    try:
        attrs = (a["active_num"], a["cap"], a["E"], a["mode"], a["ttype"], a["flag"],
                 a["has_range"], a["start"], a["end"], a["rit"])
        sx, si, st = _C.infer_moe_init_routing(a["x"], a["eidx"], *attrs)
    except moegrad.MoeError:
        sx, si, st = [6 * 2, 4], [12], [4]
    dt = a["x"].dtype if a["x"] is not None and a["x"].is_floating_point() else torch.float32
    return (poison(torch.empty(sx, dtype=dt)), poison(torch.empty(si, dtype=torch.int32)),
            poison(torch.empty(st, dtype=torch.int64)) if a["flag"] else None)


FWD_RULES = [
    # name, overrides, code, argument named
    ("x null", dict(x=None), ERR_NULL, "x"),
    ("expert_idx null", dict(eidx=None), ERR_NULL, "expert_idx"),
    ("x int dtype", dict(x=torch.ones(6, 4, dtype=torch.int32)), ERR_PARAM, "x"),
    ("x float64", dict(x=torch.ones(6, 4, dtype=torch.float64)), ERR_PARAM, "x"),
    ("expert_idx float", dict(eidx=torch.zeros(6, 2)), ERR_PARAM, "expert_idx"),
    ("x non-contiguous", dict(x=torch.randn(4, 6).t()), ERR_PARAM, "x"),
    ("mode 2", dict(mode=2), ERR_SHAPE, "drop_pad_mode"),
    ("mode -1", dict(mode=-1), ERR_SHAPE, "drop_pad_mode"),
    ("E < 0", dict(E=-1, flag=False), ERR_SHAPE, "expert_num"),
    ("active_num < -1", dict(active_num=-2), ERR_SHAPE, "active_num"),
    ("dropless capacity < -1", dict(cap=-5), ERR_SHAPE, "expert_capacity"),
    ("drop/pad active_num < -1", dict(mode=1, cap=2, active_num=-2), ERR_SHAPE, "active_num"),
    ("mode 1 E = 0", dict(mode=1, E=0, cap=2, flag=False), ERR_SHAPE, "expert_num"),
    ("mode 1 C = 0", dict(mode=1, cap=0), ERR_SHAPE, "expert_capacity"),
    ("mode 1 row_idx_type 1", dict(mode=1, cap=2, rit=1), ERR_SHAPE, "row_idx_type"),
    ("row_idx_type 2", dict(rit=2), ERR_SHAPE, "row_idx_type"),
    ("token type 3", dict(ttype=3), ERR_SHAPE, "expert_tokens_num_type"),
    ("counts without E", dict(E=0), ERR_SHAPE, "expert_num"),
    ("range without E", dict(E=0, flag=False, has_range=True, start=0, end=1), ERR_SHAPE,
     "expert_num"),
    ("range start >= end", dict(has_range=True, start=2, end=2), ERR_SHAPE,
     "active_expert_range"),
    ("range end > E", dict(has_range=True, start=0, end=5), ERR_SHAPE, "active_expert_range"),
    ("range start < 0", dict(has_range=True, start=-1, end=2), ERR_SHAPE,
     "active_expert_range"),
    ("mode 1 partial range", dict(mode=1, cap=2, has_range=True, start=1, end=4), ERR_SHAPE,
     "active_expert_range"),
    ("x 1-D", dict(x=torch.randn(6)), ERR_SHAPE, "x"),
    ("x 3-D", dict(x=torch.randn(6, 4, 1)), ERR_SHAPE, "x"),
    ("expert_idx 1-D", dict(eidx=torch.zeros(6, dtype=torch.int32)), ERR_SHAPE, "expert_idx"),
    ("dim 0 differ", dict(eidx=torch.zeros(5, 2, dtype=torch.int32)), ERR_SHAPE, "expert_idx"),
    ("H = 0", dict(x=torch.randn(6, 0)), ERR_SHAPE, "x"),
    ("K = 0", dict(eidx=torch.zeros(6, 0, dtype=torch.int32)), ERR_SHAPE, "expert_idx"),
    ("id >= E", dict(eidx=torch.tensor([[0, 1]] * 5 + [[0, 4]], dtype=torch.int32)), ERR_SHAPE,
     "expert_idx"),
    ("negative id", dict(eidx=torch.tensor([[0, 1]] * 5 + [[-1, 0]], dtype=torch.int32)),
     ERR_SHAPE, "expert_idx"),
    ("negative id, E unknown", dict(E=0, flag=False,
                                    eidx=torch.tensor([[0, 1]] * 5 + [[-1, 0]],
                                                      dtype=torch.int32)),
     ERR_SHAPE, "expert_idx"),
]


@pytest.mark.parametrize("name,over,code,arg", FWD_RULES, ids=[r[0] for r in FWD_RULES])
def test_forward_validation(name, over, code, arg):
    a = _fwd_args(**over)
    outs = _good_outs(a)
    before = [snapshot(o) for o in outs]
    with pytest.raises(moegrad.MoeError) as ei:
        _fwd_call(a, outs)
    assert ei.value.code == code, str(ei.value)
    assert_names_one_of(str(ei.value), arg)
    for o, b in zip(outs, before):
        assert (o is None and b is None) or torch.equal(snapshot(o), b), "output written"


def test_window_ids_outside_are_not_errors():
    a = _fwd_args(eidx=torch.tensor([[0, 9]] * 6, dtype=torch.int32), has_range=True, start=0,
                  end=2)
    _fwd_call(a)


OUT_RULES = [
    ("expanded_x null", 0, None, ERR_NULL, "expanded_x"),
    ("expanded_row_idx null", 1, None, ERR_NULL, "expanded_row_idx"),
    ("counts null", 2, None, ERR_NULL, "expert_tokens_count_or_cumsum"),
    ("expanded_x dtype", 0, torch.empty(12, 4, dtype=torch.float16), ERR_PARAM, "expanded_x"),
    ("expanded_row_idx dtype", 1, torch.empty(12, dtype=torch.int64), ERR_PARAM,
     "expanded_row_idx"),
    ("counts dtype", 2, torch.empty(4, dtype=torch.float32), ERR_PARAM,
     "expert_tokens_count_or_cumsum"),
    ("expanded_x shape", 0, torch.empty(11, 4), ERR_SHAPE, "expanded_x"),
    ("expanded_row_idx shape", 1, torch.empty(13, dtype=torch.int32), ERR_SHAPE,
     "expanded_row_idx"),
    ("counts shape", 2, torch.empty(5, dtype=torch.int64), ERR_SHAPE,
     "expert_tokens_count_or_cumsum"),
]


@pytest.mark.parametrize("name,pos,bad,code,arg", OUT_RULES, ids=[r[0] for r in OUT_RULES])
def test_forward_output_validation(name, pos, bad, code, arg):
    a = _fwd_args()
    outs = list(_good_outs(a))
    outs[pos] = poison(bad) if bad is not None else None
    before = [snapshot(o) for o in outs]
    with pytest.raises(moegrad.MoeError) as ei:
        _fwd_call(a, outs)
    assert ei.value.code == code, str(ei.value)
    assert_names_one_of(str(ei.value), arg)
    for o, b in zip(outs, before):
        assert (o is None and b is None) or torch.equal(snapshot(o), b), "output written"


def _grad_call(g, idx, k=2, mode=0, active=0, out=None, infer=True):
    if out is None:
        out = poison(torch.empty(idx.shape[0] // max(k, 1) if idx is not None and idx.dim() == 1
                                 else 3, g.shape[-1] if g is not None and g.dim() else 2,
                                 dtype=g.dtype if g is not None and g.is_floating_point()
                                 else torch.float32))
    return _C.moe_init_routing_grad(g, idx, k, mode, active, out), out


IDX6 = torch.tensor([4, 1, 2, 0, 5, 3], dtype=torch.int32)
GRAD_RULES = [
    ("grad null", dict(g=None), ERR_NULL, "grad_expanded_x"),
    ("idx null", dict(idx=None), ERR_NULL, "expanded_row_idx"),
    ("grad int", dict(g=torch.ones(6, 2, dtype=torch.int32)), ERR_PARAM, "grad_expanded_x"),
    ("idx float", dict(idx=IDX6.float()), ERR_PARAM, "expanded_row_idx"),
    ("idx int64 past int32", dict(idx=torch.tensor([4, 1, 2, 0, 2**33, 3])), ERR_SHAPE,
     "expanded_row_idx"),
    ("grad non-contiguous", dict(g=torch.randn(2, 6).t()), ERR_PARAM, "grad_expanded_x"),
    ("out dtype", dict(out=torch.empty(3, 2, dtype=torch.float16)), ERR_PARAM, "grad_x"),
    ("mode 2", dict(mode=2), ERR_SHAPE, "drop_pad_mode"),
    ("top_k 0", dict(k=0), ERR_SHAPE, "top_k"),
    ("active < 0", dict(active=-1), ERR_SHAPE, "active_num"),
    ("len not multiple of K", dict(k=4), ERR_SHAPE, "expanded_row_idx"),
    ("idx 2-D", dict(idx=IDX6.reshape(3, 2)), ERR_SHAPE, "expanded_row_idx"),
    ("grad 3-D in mode 0", dict(g=torch.ones(6, 1, 2)), ERR_SHAPE, "grad_expanded_x"),
    ("grad 2-D in mode 1", dict(mode=1), ERR_SHAPE, "grad_expanded_x"),
    ("dim0 != R*K", dict(g=torch.ones(5, 2)), ERR_SHAPE, "grad_expanded_x"),
    ("dim0 != active", dict(active=4), ERR_SHAPE, "grad_expanded_x"),
    ("H = 0", dict(g=torch.ones(6, 0), out=torch.empty(3, 0)), ERR_SHAPE, "grad_expanded_x"),
    ("out shape", dict(out=torch.empty(3, 3)), ERR_SHAPE, "grad_x"),
    ("idx >= R*K", dict(idx=torch.tensor([4, 1, 2, 0, 6, 3], dtype=torch.int32)), ERR_SHAPE,
     "expanded_row_idx"),
    ("idx < -1", dict(idx=torch.tensor([4, 1, 2, -2, 5, 3], dtype=torch.int32)), ERR_SHAPE,
     "expanded_row_idx"),
    ("idx repeated", dict(idx=torch.tensor([4, 1, 2, 4, 5, 3], dtype=torch.int32)), ERR_SHAPE,
     "expanded_row_idx"),
    ("drop-pad idx >= E*C", dict(g=torch.ones(2, 2, 2), mode=1,
                                 idx=torch.tensor([0, 1, 4, -1, 2, 3], dtype=torch.int32)),
     ERR_SHAPE, "expanded_row_idx"),
]


@pytest.mark.parametrize("name,over,code,arg", GRAD_RULES, ids=[r[0] for r in GRAD_RULES])
def test_grad_validation(name, over, code, arg):
    a = dict(g=torch.randn(6, 2), idx=IDX6, k=2, mode=0, active=0, out=None)
    a.update(over)
    out = a["out"]
    if out is None:
        out = torch.empty(3, 2)
    poison(out)
    before = snapshot(out)
    with pytest.raises(moegrad.MoeError) as ei:
        _C.moe_init_routing_grad(a["g"], a["idx"], a["k"], a["mode"], a["active"], out)
    assert ei.value.code == code, str(ei.value)
    assert_names_one_of(str(ei.value), arg)
    assert torch.equal(snapshot(out), before), "output written"


def test_int64_indices_match_int32(rng):
    """int64 expert ids and indices are taken as they are (no host-side narrowing, D20)."""
    x = randn((19, 6), torch.bfloat16, rng)
    e32 = rand_expert_idx(19, 3, 8, rng)
    for kw in (dict(expert_num=8), dict(expert_num=8, active_expert_range=[2, 7]),
               dict(expert_num=8, drop_pad_mode=1, expert_capacity=5)):
        a = moegrad.moe_init_routing(x, e32, **kw)
        b = moegrad.moe_init_routing(x, e32.long(), **kw)
        for u, v in zip(a, b):
            assert torch.equal(u, v)
        g = randn(tuple(a[0].shape), torch.bfloat16, rng)
        mode = kw.get("drop_pad_mode", 0)
        assert torch.equal(moegrad.moe_init_routing_grad(g, a[1], 3, mode),
                           moegrad.moe_init_routing_grad(g, a[1].long(), 3, mode))
    with pytest.raises(moegrad.MoeError) as ei:
        moegrad.moe_init_routing(x, e32.long() + 2**32, expert_num=8,
                                 active_expert_range=[0, 8])
    assert ei.value.code == ERR_SHAPE


def test_grad_active_larger_than_slots():
    # A > R*K: the forward keeps R*K rows and the backward accepts them (docs/decisions.md L34).
    out = moegrad.moe_init_routing_grad(G, IDX6, 2, 0, 100)
    assert out.tolist() == [[12, 14], [6, 8], [18, 20]]


# ---------------------------------------------------------------------- autograd / torch --
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kw", [dict(), dict(active_num=20),
                                dict(drop_pad_mode=1, expert_capacity=5),
                                dict(active_expert_range=[2, 6])])
def test_autograd_grad_x(kw, dtype, rng):
    x = randn((17, 6), dtype, rng).requires_grad_(True)
    eidx = rand_expert_idx(17, 3, 8, rng)
    ex, idx, _ = moegrad.moe_init_routing(x, eidx, expert_num=8, **kw)
    up = randn(tuple(ex.shape), dtype, rng)
    (ex * up).sum().backward()
    want = ref.moe_init_routing_grad(up, idx, 3, kw.get("drop_pad_mode", 0),
                                     kw.get("active_num", 0))
    scale = ref.moe_init_routing_grad(up.abs(), idx, 3, kw.get("drop_pad_mode", 0),
                                      kw.get("active_num", 0))
    assert_close_to_ref(x.grad, want, scale=scale, n_reduce=3, what="x.grad")


def test_autograd_row_idx_type_1_raises(rng):
    x = randn((5, 3), torch.float32, rng).requires_grad_(True)
    ex, _, _ = moegrad.moe_init_routing(x, rand_expert_idx(5, 2, 4, rng), expert_num=4,
                                        row_idx_type=1)
    with pytest.raises(NotImplementedError):
        ex.sum().backward()


def test_opcheck(rng):
    x = randn((9, 4), torch.float32, rng).requires_grad_(True)
    eidx = rand_expert_idx(9, 2, 4, rng)
    for kw in (dict(expert_num=4), dict(expert_num=4, active_num=7),
               dict(expert_num=4, drop_pad_mode=1, expert_capacity=3),
               dict(expert_num=4, active_expert_range=[1, 3], expert_tokens_num_type=2)):
        args = (x, eidx, kw.get("active_num", 0), kw.get("expert_capacity", 0), 4,
                kw.get("drop_pad_mode", 0), kw.get("expert_tokens_num_type", 1), True,
                kw.get("active_expert_range"), 0)
        torch.library.opcheck(torch.ops.moegrad.moe_init_routing, args)
    g = randn((18, 4), torch.float32, rng)
    idx = moegrad.moe_init_routing(x, eidx, expert_num=4)[1]
    torch.library.opcheck(torch.ops.moegrad.moe_init_routing_grad, (g, idx, 2, 0, 0))


def test_compile_fullgraph(rng):
    x = randn((12, 8), torch.float32, rng)
    eidx = rand_expert_idx(12, 2, 4, rng)

    def f(x, e):
        ex, idx, cnt = moegrad.moe_init_routing(x, e, expert_num=4)
        return moegrad.moe_finalize_routing(ex * 2, idx, drop_pad_mode=2, k=2), cnt

    got = torch.compile(f, fullgraph=True, backend="eager")(x, eidx)
    want = f(x, eidx)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---------------------------------------------------------------------- the chain (D31) --
def _chain_reference(x, eidx, w, scales, F):
    """float64 plain-PyTorch: per slot SwiGLU of its token's row times w, combined by scales."""
    x64 = x.double()
    R, K = eidx.shape
    y = torch.zeros(R, F, dtype=torch.float64)
    for r in range(R):
        for k in range(K):
            h = x64[r] @ w.detach().double()
            a, b = h[:F], h[F:]
            y[r] += scales.detach().double()[r, k] * torch.nn.functional.silu(a) * b
    return y


@pytest.mark.parametrize("mode", [0, 1])
def test_chain_forward_and_input_grad(mode, rng):
    R, K, E, H, F = 13, 2, 4, 6, 5
    x = randn((R, H), torch.float32, rng).requires_grad_(True)
    w = randn((H, 2 * F), torch.float32, rng, std=0.5)
    eidx = rand_expert_idx(R, K, E, rng)
    scales = torch.rand(R, K, dtype=torch.float32)
    kw = dict(expert_num=E)
    if mode == 1:
        kw.update(drop_pad_mode=1, expert_capacity=R)  # capacity R: nothing dropped
    ex, idx, counts = moegrad.moe_init_routing(x, eidx, **kw)
    act = moegrad.swiglu_group(ex.reshape(-1, H) @ w)
    act = act.reshape(*ex.shape[:-1], F)
    y = moegrad.moe_finalize_routing(act, idx, scales=scales, drop_pad_mode=2 + mode)
    want = _chain_reference(x.detach(), eidx, w, scales, F)
    assert torch.allclose(y.double(), want, rtol=1e-4, atol=1e-5)
    # Gradient w.r.t. x through init routing, with finalize's grad applied by hand.
    up = randn((R, F), torch.float32, rng)
    gex, _ = moegrad.moe_finalize_routing_grad(
        up, idx, act.detach(), scales, drop_pad_mode=mode,
        active_num=act.shape[0] if mode == 0 else 0,
        expert_num=E if mode == 1 else 0, expert_capacity=R if mode == 1 else 0)
    act.backward(gex)
    xr = x.detach().double().requires_grad_(True)
    (_chain_reference(xr, eidx, w, scales, F) * up.double()).sum().backward()
    assert torch.allclose(x.grad.double(), xr.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kw", [dict(), dict(drop_pad_mode=1, expert_capacity=4),
                                dict(active_expert_range=[1, 3]), dict(active_num=15)],
                         ids=["dropless", "drop-pad", "window", "active"])
def test_chain_trains_end_to_end(kw, rng):
    """init routing -> SwiGLU -> finalize (mode 2/3) with autograd all the way (D31): x, the
    expert weight and the scales get the float64 gradients of the same computation; slots that
    are dropped, outside the window or truncated contribute nothing (index -1 / >= rows, D29)."""
    R, K, E, H, F = 11, 2, 4, 6, 5
    x = randn((R, H), torch.float32, rng).requires_grad_(True)
    w = randn((H, 2 * F), torch.float32, rng, std=0.5).requires_grad_(True)
    scales = torch.rand(R, K, dtype=torch.float32).requires_grad_(True)
    eidx = rand_expert_idx(R, K, E, rng)
    ex, idx, _ = moegrad.moe_init_routing(x, eidx, expert_num=E, **kw)
    mode = kw.get("drop_pad_mode", 0)
    act = moegrad.swiglu_group(ex.reshape(-1, H) @ w).reshape(*ex.shape[:-1], F)
    y = moegrad.moe_finalize_routing(act, idx, scales=scales, drop_pad_mode=2 + mode)
    up = randn((R, F), torch.float32, rng)
    (y * up).sum().backward()
    # float64 reference: each slot whose index addresses a materialised row.
    rows = ex.shape[0] * (ex.shape[1] if mode == 1 else 1)
    live = (idx >= 0) & (idx < rows)
    xr = x.detach().double().requires_grad_(True)
    wr = w.detach().double().requires_grad_(True)
    sr = scales.detach().double().requires_grad_(True)
    yr = torch.zeros(R, F, dtype=torch.float64)
    for r in range(R):
        for k in range(K):
            if live[r * K + k]:
                h = xr[r] @ wr
                yr = yr.index_add(0, torch.tensor([r]),
                                  (sr[r, k] * torch.nn.functional.silu(h[:F]) * h[F:])[None])
    (yr * up.double()).sum().backward()
    assert torch.allclose(y.double(), yr, rtol=1e-4, atol=1e-5)
    for got, want, name in ((x.grad, xr.grad, "x"), (w.grad, wr.grad, "w"),
                            (scales.grad, sr.grad, "scales")):
        assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-5), name
    if "active_expert_range" in kw:
        assert (~live).any() and (idx[~live] == -1).all()


@pytest.mark.parametrize("kw", [
    {}, dict(active_num=1500), dict(active_num=10000), dict(active_expert_range=[3, 12]),
    dict(active_expert_range=[3, 12], row_idx_type=1), dict(row_idx_type=1),
    dict(drop_pad_mode=1, expert_capacity=300), dict(expert_tokens_num_type=2),
])
def test_large_x_takes_the_token_order_copy(kw, rng):
    """x of >= 8 MB is copied in token order (docs/decisions.md L113: each x row read once and
    written to its slots' rows, then the unaddressed rows zeroed): into poisoned buffers, equal
    to the reference bit for bit, with a window, fewer and more active rows than slots, both
    row_idx_types and drop-pad padding, at 1, 2 and 3 threads."""
    R, K, E, H = 2100, 2, 16, 1001
    x = randn((R, H), torch.float32, rng)
    assert x.numel() * 4 >= 8 << 20
    eidx = rand_expert_idx(R, K, E, rng)
    rg = kw.get("active_expert_range")
    attrs = (kw.get("active_num", 0), kw.get("expert_capacity", 0), E,
             kw.get("drop_pad_mode", 0), kw.get("expert_tokens_num_type", 1), True,
             rg is not None, *(rg or (0, 0)), kw.get("row_idx_type", 0))
    rex, ridx, rtok = ref.moe_init_routing(x, eidx, expert_num=E, **kw)
    for n in (1, 2, 3):
        old = _C.get_num_threads()
        _C.set_num_threads(n)
        try:
            sx, si, st = _C.infer_moe_init_routing(x, eidx, *attrs)
            ex = poison(torch.empty(sx))
            idx = poison(torch.empty(si, dtype=torch.int32))
            tok = poison(torch.empty(st, dtype=torch.int64))
            _C.moe_init_routing(x, eidx, *attrs, ex, idx, tok)
        finally:
            _C.set_num_threads(old)
        assert torch.equal(ex.double(), torch.from_numpy(rex)), f"{n} threads"
        assert not torch.signbit(ex[ex == 0]).any(), "padding rows must be +0.0"
        assert idx.tolist() == ridx.tolist() and tok.tolist() == rtok.tolist(), f"{n} threads"
