"""The benchmark harness (python -m moegrad.bench) and its PyTorch baselines.

* The harness runs end to end in its smallest mode (--tiny --no-compile), writes JSON records
  with every field, checks moegrad against the eager formula per case (and reports a planted
  mismatch), and writes the plot. No timing is asserted.
* The eager baselines of moegrad.reference_torch are themselves checked against the independent
  float64 reference (reference.py), so the benchmark's per-case check compares moegrad with a
  formula that is known to be right.
"""
from __future__ import annotations

import io
import json
import math
import re
import time

import numpy as np
import pytest
import torch

import moegrad
from moegrad import bench
from moegrad.bench import roof
from moegrad import reference_torch as rt
from moegrad.bench.report import progress

import reference as ref
from conftest import (assert_close_to_ref, rand_droppad_idx, rand_perm_idx, randn,
                      tie_free_gating_inputs, uniform)

RECORD_FIELDS = {
    "op": str, "model": str, "dtype": str, "shape": dict, "desc": str, "bytes": int,
    "ms_moegrad": float, "ms_kernel": float, "ms_eager": float, "gbps": float,
    "gbps_api": float, "roofline_frac": float, "speedup_eager": float, "threads": int,
    "copy_gbps": float, "n_sets": int, "cold": bool, "check": str, "copy_samples": list,
    "attempts": int, "copy_low": bool, "read_gbps": float, "write_gbps": float,
    "stream_copy_gbps": float, "read_bytes": int, "write_bytes": int, "ms_roof": float,
    "roof_frac": float,
}


# ---------------------------------------------------------------------------------------------
# the harness
# ---------------------------------------------------------------------------------------------
def test_bench_tiny_run_writes_checked_records(tmp_path, seed):
    out_json, out_png = tmp_path / "perf.json", tmp_path / "perf.png"
    threads_before = torch.get_num_threads()
    rc = bench.main(["--tiny", "--no-compile", "--threads", "1", "--seed", str(seed),
                     "--json", str(out_json), "--plot", str(out_png)])
    assert torch.get_num_threads() == threads_before, "bench must restore torch's threads"
    doc = json.loads(out_json.read_text())
    meta, records = doc["meta"], doc["records"]
    assert rc == 0, [r["check"] for r in records if r["check"] != "ok"]
    assert meta["seed"] == seed and meta["threads"] == 1 and meta["mode"] == "tiny"
    assert meta["copy_gbps"] > 0 and meta["llc_bytes"] > 0
    for key in ("roof_start", "roof_end"):
        assert set(meta[key]) == set(bench.roof.KINDS) and min(meta[key].values()) > 0
    assert meta["clock_ghz"] > 0
    assert set(meta["bytes_definition"]) == set(bench.OPS)
    assert {r["op"] for r in records} == set(bench.OPS)
    for r in records:
        for name, typ in RECORD_FIELDS.items():
            assert isinstance(r[name], typ), (r["op"], name, r[name])
        assert r["ms_compile"] is None and r["speedup_compile"] is None  # --no-compile
        # moegrad's outputs equal the eager formula's (checked by the harness, once per case)
        assert r["check"] == "ok", (r["op"], r["model"], r["shape"], r["check"])
        assert r["threads"] == 1 and r["dtype"] == "bf16"
        for t in ("ms_moegrad", "ms_kernel", "ms_eager"):
            assert math.isfinite(r[t]) and r[t] > 0, (r["op"], t, r[t])
        # derived columns are consistent with the raw ones
        assert r["gbps"] == pytest.approx(r["bytes"] / (r["ms_kernel"] * 1e6))
        assert r["roofline_frac"] == pytest.approx(r["gbps"] / r["copy_gbps"])
        # the denominator is the median of the copy samples of the case's own window
        assert len(r["copy_samples"]) == 3 and all(c > 0 for c in r["copy_samples"])
        assert r["copy_gbps"] == pytest.approx(float(np.median(r["copy_samples"])))
        # the streaming roof: reads at the read bandwidth plus writes at the write bandwidth
        assert r["read_bytes"] + r["write_bytes"] == r["bytes"] and r["write_bytes"] > 0
        assert r["ms_roof"] == pytest.approx(1e-6 * (r["read_bytes"] / r["read_gbps"]
                                                     + r["write_bytes"] / r["write_gbps"]))
        assert r["roof_frac"] == pytest.approx(r["ms_roof"] / r["ms_kernel"])
        if r["op"] in bench.ROOF_EXEMPT:  # compute-bound: cycles per token at the clock
            assert r["cycles_per_token"] == pytest.approx(
                r["ms_kernel"] * 1e6 * r["clock_ghz"] * r["threads"] / r["shape"]["T"])
        assert 1 <= r["attempts"] <= 1 + bench.REMEASURE
        assert r["speedup_eager"] == pytest.approx(r["ms_eager"] / r["ms_moegrad"])
        # the bytes column follows the documented per-op formula
        case = bench.build_case(r["op"], r["model"], r["dtype"], r["shape"]["T"])
        assert r["bytes"] == case.bytes
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _LogProbe:
    """A copy probe that logs when it is sampled and returns the next value of `values`."""

    def __init__(self, log, values):
        self.log, self.values = log, list(values)

    def measure(self, reps=5):
        self.log.append("probe")
        return self.values.pop(0)


def test_time_interleaved_shares_one_window():
    """Every round takes a copy sample and then gives each method calls, so all methods and the
    samples come from the same stretch of time; medians are over each method's own calls."""
    log = []

    def fn(name, set_i):
        return lambda: log.append((name, set_i))

    methods = {"a": [fn("a", 0), fn("a", 1)], "b": [fn("b", 0), fn("b", 1), fn("b", 2)]}
    budget = bench.Budget(min_calls=4, max_calls=4, seconds=10.0, warmup_calls=1)
    med, samples = bench.time_interleaved(methods, budget, _LogProbe(log, [5.0, 7.0, 6.0]), 2)
    assert samples == [5.0, 7.0, 6.0] and set(med) == {"a", "b"}
    assert all(v >= 0 for v in med.values())
    timed = log[log.index("probe"):]
    rounds, cur = [], None
    for e in timed:
        if e == "probe":
            cur = []
            rounds.append(cur)
        else:
            cur.append(e[0])
    # two rounds, each with both methods' calls (an untimed lead-in, then 2 = ceil(4 / 2)
    # timed), in method order, and the closing sample
    assert rounds == [["a"] * 3 + ["b"] * 3, ["a"] * 3 + ["b"] * 3, []], timed
    assert timed[-1] == "probe"
    # each method rotates through its buffer sets, continuing after its warm-up pass
    assert [s for n, s in (e for e in log if e != "probe") if n == "b"] == [0, 1, 2] * 3


def test_time_interleaved_times_only_calls_after_a_lead_in(monkeypatch):
    """The first call of a method in each round is not timed (a lead-in): a call that is slow
    only because another method ran before it (fresh memory the VM had returned to its host)
    does not enter the median. Slow methods (one call per round) get no lead-in."""
    clock = {"t": 0.0, "prev": None}
    calls = {"a": 0, "slow": 0}

    def fake_perf_counter():
        return clock["t"]

    def step(name, cost_first, cost_next):
        def f():
            calls[name] += 1
            clock["t"] += cost_first if clock["prev"] != name else cost_next
            clock["prev"] = name
        return f

    methods = {"a": [step("a", 5.0, 1.0)], "slow": [step("slow", 20.0, 20.0)]}
    budget = bench.Budget(min_calls=3, max_calls=3, seconds=10.0, warmup_calls=1)
    monkeypatch.setattr(bench.ops.time, "perf_counter", fake_perf_counter)
    med, _ = bench.time_interleaved(methods, budget, None, 3)
    assert med["a"] == 1.0, med           # every timed call of a followed a call of a
    assert med["slow"] == 20.0
    # slow: 1 warm-up call and one per round, no lead-ins; a: 1 warm-up, 3 x (lead-in + 1)
    assert calls == {"a": 7, "slow": 4}, calls


def test_remeasure_low_copy_keeps_the_best_window(monkeypatch):
    """Cases whose copy bandwidth fell below LOW_COPY x the run's best case are measured again
    (at most REMEASURE times); the attempt with the higher copy bandwidth is kept."""
    def rec(name, copy):
        return dict(op=name, model="m", dtype="bf16", shape=dict(T=1), desc="", bytes=1,
                    ms_moegrad=1.0, ms_kernel=1.0, ms_eager=1.0, ms_compile=None, gbps=1.0,
                    roofline_frac=1.0 / copy, speedup_eager=1.0, speedup_compile=None,
                    threads=1, copy_gbps=copy, check="ok", attempts=1)

    records = [rec(f"c{i}", c) for i, c in enumerate([80, 79, 81, 78, 80, 82, 80, 79, 80, 40,
                                                      45])]
    cases = [(bench.build_case("swiglu_group", "gpt_oss", "bf16", 1), False)] * len(records)
    again = {"c9": [60.0, 75.0], "c10": [30.0, 30.0]}   # c9 improves twice, c10 never

    def fake_run_case(case, args, llc, copy, seed, comp, budget, probe, rounds):
        name = next(r["op"] for r in records if r["copy_gbps"] == copy)
        return rec(name, again[name].pop(0))

    monkeypatch.setattr(bench.ops, "run_case", fake_run_case)
    meta = {}
    args = bench.parse_args(["--seed", "1"])
    bench.remeasure_low_copy(records, cases, args, 0, bench.Budget(), None, 1, meta)
    # with no time left nothing is measured again
    again2 = [rec("a", 80), rec("b", 40)]
    calls = []
    monkeypatch.setattr(bench.ops, "run_case", lambda *a, **k: calls.append(1) or rec("b", 80))
    bench.remeasure_low_copy(again2, cases[:2], args, 0, bench.Budget(), None, 1, {},
                             budget_s=-1.0)
    assert not calls and again2[1]["copy_low"] and again2[1]["attempts"] == 1
    assert meta["copy_gbps_reference"] == 82
    by = {r["op"]: r for r in records}
    assert by["c9"]["copy_gbps"] == 75.0 and by["c9"]["attempts"] == 3
    assert not by["c9"]["copy_low"]
    assert by["c10"]["copy_gbps"] == 45 and by["c10"]["attempts"] == 3 and by["c10"]["copy_low"]
    assert all(by[f"c{i}"]["attempts"] == 1 and not by[f"c{i}"]["copy_low"] for i in range(9))


def test_bench_reports_a_mismatch(monkeypatch, capsys, tmp_path, seed):
    """Plant a wrong eager formula: the per-case check must flag it and the exit status be 1."""
    good = rt.swiglu_group
    monkeypatch.setattr(rt, "swiglu_group", lambda *a, **k: good(*a, **k) * 1.5)
    out_json = tmp_path / "perf.json"
    rc = bench.main(["--tiny", "--no-compile", "--threads", "1", "--ops", "swiglu_group",
                     "--models", "deepseek_v3", "--tokens", "16", "--seed", str(seed),
                     "--json", str(out_json)])
    records = json.loads(out_json.read_text())["records"]
    assert rc == 1
    assert len(records) == 1 and records[0]["check"].startswith("MISMATCH y"), records
    captured = capsys.readouterr()
    assert "MISMATCH" in captured.out
    # progress on stderr before the case (the table stays on stdout)
    assert re.search(r"^\[1/1\] swiglu_group deepseek_v3 bf16 T=16 \(\d+s elapsed\)$",
                     captured.err, re.M), captured.err


def test_progress_line_estimates_the_time_left():
    out = io.StringIO()
    now = time.time()
    assert progress(0, 5, "op a", now, out) == "[1/5] op a (0s elapsed)"
    line = progress(2, 5, "op c", now - 130, out)   # 65 s per case so far, 3 cases to go
    assert line == "[3/5] op c (2m10s elapsed, ~3m15s left)", line
    assert out.getvalue().splitlines() == ["[1/5] op a (0s elapsed)", line]


def test_bytes_table_matches_the_tensors(seed):
    """The BYTES formulas equal the nbytes of the tensors the native call touches (all models,
    both dtypes, a non-trivial token count)."""
    g = torch.Generator().manual_seed(seed)
    for op in bench.OPS:
        for model in bench.MODELS:
            for dt in ("fp32", "bf16"):
                case = bench.build_case(op, model, dt, 3)
                assert bench.tensors_nbytes(case.make(g)) == case.bytes, (op, model, dt)


def test_case_sizes_and_skips():
    """Expanded rows and SwiGLU widths follow the model table; the largest DeepSeek SwiGLU
    backward is above the default memory limit and is skipped, a mid-size case is not."""
    c = bench.build_case("swiglu_group_quant_backward", "deepseek_v3", "bf16", 16384)
    assert c.dims["Tk"] == 16384 * 8 and c.dims["F"] == 2048
    limit = bench.DEFAULT_MEM_LIMIT_GB * 1e9
    assert bench.estimate_memory(c, 1, True) > limit
    c = bench.build_case("moe_finalize_routing_grad", "gpt_oss", "fp32", 1024)
    assert c.dims == dict(R=1024, K=4, H=2880, T=1024)
    assert bench.estimate_memory(c, bench.n_sets_for(c.bytes, 32 << 20, 4096), True) < limit
    assert bench.n_sets_for(1 << 10, 32 << 20, 4096) == 4096
    assert bench.n_sets_for(1 << 30, 32 << 20, 4096) == 1


# ---------------------------------------------------------------------------------------------
# reference_torch against the float64 reference
# ---------------------------------------------------------------------------------------------
DTS = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@DTS
@pytest.mark.parametrize("mode", ["deepseek", "softmax_renorm", "softmax_plain", "sqrt_softplus"])
def test_reference_torch_gating(rng, dtype, mode):
    M, N, k = 37, 64, 6
    cfg = dict(deepseek=dict(norm_type=1, with_bias=True, k_group=4, group_count=8,
                             group_select_mode=1, renorm=0, rsf=2.5),
               softmax_renorm=dict(norm_type=0, with_bias=False, k_group=1, group_count=1,
                                   group_select_mode=0, renorm=1, rsf=1.0),
               softmax_plain=dict(norm_type=0, with_bias=True, k_group=2, group_count=4,
                                  group_select_mode=0, renorm=0, rsf=0.5),
               sqrt_softplus=dict(norm_type=2, with_bias=False, k_group=1, group_count=1,
                                  group_select_mode=0, renorm=0, rsf=1.0))[mode]
    sel = dict(k_group=cfg["k_group"], group_count=cfg["group_count"],
               group_select_mode=cfg["group_select_mode"])
    x, bias = tie_free_gating_inputs(M, N, dtype, rng, k, norm_type=cfg["norm_type"],
                                     with_bias=cfg["with_bias"], **sel)
    y, idx, norm = rt.moe_gating_top_k(x, k, bias, renorm=cfg["renorm"],
                                       norm_type=cfg["norm_type"], out_flag=True,
                                       routed_scaling_factor=cfg["rsf"], **sel)
    y_ref, idx_ref, norm_ref = ref.moe_gating_top_k(
        x, k, bias, renorm=cfg["renorm"], norm_type=cfg["norm_type"], out_flag=True,
        routed_scaling_factor=cfg["rsf"], **sel)
    assert idx.dtype == torch.int32 and y.dtype == dtype
    np.testing.assert_array_equal(idx.numpy(), idx_ref)
    n_red = N + k
    assert_close_to_ref(norm, norm_ref, torch.float32, n_reduce=N, what="norm_out")
    assert_close_to_ref(y, y_ref, dtype, scale=np.abs(y_ref) * 4, n_reduce=n_red, what="y")
    _, _, zeros = rt.moe_gating_top_k(x, k, bias, norm_type=cfg["norm_type"], **sel)
    assert torch.all(zeros == 0)  # L1


@DTS
def test_reference_torch_gating_backward(rng, dtype):
    M, N, k = 41, 96, 8
    x_norm = torch.sigmoid(randn((M, N), torch.float32, rng, 2.0))
    grad_y = randn((M, k), dtype, rng)
    idx = torch.from_numpy(np.argsort(rng.random((M, N)), 1)[:, :k].copy()).to(torch.int32)
    idx[0, 1] = idx[0, 0]  # a repeated id is summed (D1)
    gx = rt.moe_gating_top_k_backward(x_norm, grad_y, idx, routed_scaling_factor=2.5, eps=1e-20)
    assert gx.dtype == dtype
    exp = ref.moe_gating_top_k_backward(x_norm, grad_y, idx, routed_scaling_factor=2.5)
    mag = ref.gating_backward_magnitude(x_norm, grad_y, idx, routed_scaling_factor=2.5)
    assert_close_to_ref(gx, exp, dtype, scale=mag, n_reduce=k + 1, what="grad_x")


@DTS
@pytest.mark.parametrize("drop_pad_mode", [0, 1, 2, 3])
def test_reference_torch_finalize_routing(rng, dtype, drop_pad_mode):
    R, K, H, E, C = 29, 4, 67, 5, 30
    if drop_pad_mode in (1, 3):
        ex = randn((E, C, H), dtype, rng)
        idx = rand_droppad_idx(R * K, E, C, rng)
    else:
        ex = randn((R * K - 3, H), dtype, rng)  # active_num-truncated rows: L5 skips
        idx = rand_perm_idx(R * K, rng)
    x1, x2 = randn((R, H), dtype, rng), randn((R, H), dtype, rng)
    bias = randn((E, H), dtype, rng)
    scales = uniform((R, K), dtype, rng, 0.0, 1.0)
    eidx = torch.from_numpy(rng.integers(0, E, (R, K))).to(torch.int32)
    kw = dict(x1=x1, x2=x2, bias=bias, scales=scales, expert_idx=eidx,
              drop_pad_mode=drop_pad_mode)
    out = rt.moe_finalize_routing(ex, idx, **kw)
    exp = ref.moe_finalize_routing(ex, idx, **kw)
    mag = ref.finalize_routing_magnitude(ex, idx, **kw)
    assert out.dtype == dtype
    assert_close_to_ref(out, exp, dtype, scale=mag, n_reduce=K + 2, what="out")
    # no scales, no skip tensors: K from k (L4)
    out = rt.moe_finalize_routing(ex, idx, drop_pad_mode=drop_pad_mode, k=K)
    exp = ref.moe_finalize_routing(ex, idx, drop_pad_mode=drop_pad_mode, R=R, K=K)
    mag = ref.finalize_routing_magnitude(ex, idx, drop_pad_mode=drop_pad_mode, R=R, K=K)
    assert_close_to_ref(out, exp, dtype, scale=mag, n_reduce=K, what="out k")


@DTS
@pytest.mark.parametrize("variant", ["dropless", "active_num", "droppad_bias", "no_scales"])
def test_reference_torch_finalize_routing_grad(rng, dtype, variant):
    R, K, H, E, C = 23, 3, 71, 4, 20
    gy = randn((R, H), dtype, rng)
    kw = dict(drop_pad_mode=0)
    if variant == "no_scales":
        K = 1
        idx = rand_perm_idx(R, rng)
    elif variant == "droppad_bias":
        idx = rand_droppad_idx(R * K, E, C, rng)
        kw.update(drop_pad_mode=1, expert_num=E, expert_capacity=C,
                  expanded_x=randn((E, C, H), dtype, rng), bias=randn((E, H), dtype, rng),
                  expert_idx=torch.from_numpy(rng.integers(0, E, (R, K))).to(torch.int32))
    else:
        idx = rand_perm_idx(R * K, rng)
        active = R * K - 7 if variant == "active_num" else 0
        rows = active or R * K
        kw.update(active_num=active, expanded_x=randn((rows, H), dtype, rng))
    if variant != "no_scales":
        kw["scales"] = uniform((R, K), dtype, rng, -1.0, 1.0)
    gex, gsc = rt.moe_finalize_routing_grad(gy, idx, **kw)
    exp_gex, exp_gsc = ref.moe_finalize_routing_grad(gy, idx, **kw)
    _, mag = ref.moe_finalize_routing_grad(gy, idx, **kw, _abs=True)
    assert gex.dtype == dtype and gsc.dtype == dtype
    assert_close_to_ref(gex, exp_gex, dtype, what="grad_expanded_x")
    assert_close_to_ref(gsc, exp_gsc, dtype, scale=mag, n_reduce=H, what="grad_scales")


@DTS
@pytest.mark.parametrize("clamp", [-1.0, 1.5])
def test_reference_torch_swiglu(rng, dtype, clamp):
    T, H, G = 45, 66, 5
    x = randn((T, 2 * H), dtype, rng, 2.0)
    w = uniform((T,), torch.float32, rng, -1.0, 1.0)
    gi = torch.tensor([7, 0, 11, 9, 3], dtype=torch.int64)  # trunc 30 < T
    assert gi.numel() == G
    y = rt.swiglu_group(x, w, gi, clamp)
    assert y.dtype == dtype
    assert_close_to_ref(y, ref.swiglu_group(x, w, gi, clamp), dtype, what="y")
    gy, yo = randn((T, H), dtype, rng), randn((T, H), dtype, rng)
    gx, gw = rt.swiglu_group_quant_backward(gy, x, w.reshape(T, 1), yo, gi, clamp)
    exp_gx, exp_gw = ref.swiglu_group_quant_backward(gy, x, w.reshape(T, 1), yo, gi, clamp)
    mag_gx, mag_gw = ref.swiglu_backward_magnitude(gy, x, w.reshape(T, 1), yo, gi, clamp)
    assert gx.dtype == dtype and gw.dtype == torch.float32 and gw.shape == (T, 1)
    assert_close_to_ref(gx, exp_gx, dtype, scale=mag_gx, what="grad_x")
    assert_close_to_ref(gw, exp_gw, torch.float32, scale=mag_gw, n_reduce=H, what="grad_weight")
    # no weight, no group_index: every row, empty grad_weight
    gx, gw = rt.swiglu_group_quant_backward(gy, x, None, None, None, clamp)
    exp_gx, _ = ref.swiglu_group_quant_backward(gy, x, None, None, None, clamp)
    mag_gx, _ = ref.swiglu_backward_magnitude(gy, x, None, None, None, clamp)
    assert_close_to_ref(gx, exp_gx, dtype, scale=mag_gx, what="grad_x (no weight)")
    assert gw.shape == (0,) and gw.dtype == torch.float32


def test_reference_torch_compiles(rng):
    """The baselines trace as one graph each (no host sync); torch.compile gives the same
    result as eager on one small case per op (default inductor backend would be slow: eager
    backend is enough to prove traceability)."""
    x = randn((9, 32), torch.float32, rng)
    gi = torch.tensor([4, 3], dtype=torch.int64)
    fn = torch.compile(rt.swiglu_group, backend="eager", fullgraph=True)
    torch.testing.assert_close(fn(x, None, gi, 7.0), rt.swiglu_group(x, None, gi, 7.0))
    ex, idx = randn((12, 8), torch.float32, rng), rand_perm_idx(12, rng)
    sc = uniform((4, 3), torch.float32, rng, 0, 1)
    gy = randn((4, 8), torch.float32, rng)
    fn = torch.compile(rt.moe_finalize_routing_grad, backend="eager", fullgraph=True)
    for a, b in zip(fn(gy, idx, ex, sc), rt.moe_finalize_routing_grad(gy, idx, ex, sc)):
        torch.testing.assert_close(a, b)


def _fake_record(op, T, ms_kernel, check="ok"):
    return dict(op=op, model="gpt_oss", dtype="bf16", shape=dict(T=T), desc="d", bytes=10**6 * T,
                ms_moegrad=2.0, ms_kernel=ms_kernel, ms_eager=8.0, ms_compile=None,
                gbps=T / ms_kernel, gbps_api=T / 2.0, roofline_frac=0.5, speedup_eager=4.0,
                speedup_compile=None, threads=2, copy_gbps=20.0, n_sets=2, cold=True,
                check=check, check_compile=None)


def test_from_json_merges_runs_and_writes_markdown(tmp_path):
    """--from-json re-renders saved runs: a later file's case replaces the same case of an
    earlier one, the summary takes the largest case, the markdown lists every case."""
    meta = dict(date="2026-01-01T00:00:00", threads=2, copy_gbps=20.0, copy_gbps_end=19.0,
                torch="t", moegrad="m", skipped=[])
    a = dict(meta=meta, records=[_fake_record("swiglu_group", 16, 1.0),
                                 _fake_record("swiglu_group", 256, 3.0)])
    b = dict(meta=dict(meta, date="2026-01-02T00:00:00"),
             records=[_fake_record("swiglu_group", 256, 7.0)])
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    out, md = tmp_path / "m.json", tmp_path / "m.md"
    rc = bench.main(["--from-json", f"{pa},{pb}", "--json", str(out), "--markdown", str(md)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [(r["shape"]["T"], r["ms_kernel"]) for r in doc["records"]] == [(16, 1.0), (256, 7.0)]
    assert len(doc["meta"]["merged_from"]) == 2
    assert doc["meta"]["summary"][0]["T"] == 256
    text = md.read_text()
    assert "| swiglu_group | gpt_oss | bf16 | 256 |" in text and "2026-01-02" in text
    pb.write_text(json.dumps(dict(b, records=[_fake_record("swiglu_group", 16, 1.0, "MISMATCH")])))
    assert bench.main(["--from-json", f"{pa},{pb}"]) == 1


def test_bench_overhead_mode_records_every_op(tmp_path, seed):
    """--overhead times every public op at T=16 with both registration styles and eager; the
    records carry each variant (no timing is asserted)."""
    out_json = tmp_path / "overhead.json"
    threads_before = torch.get_num_threads()
    rc = bench.main(["--overhead", "--tiny", "--threads", "1", "--seed", str(seed),
                     "--json", str(out_json)])
    assert rc == 0
    assert torch.get_num_threads() == threads_before, "bench must restore torch's threads"
    doc = json.loads(out_json.read_text())
    assert doc["meta"]["mode"] == "overhead"
    assert {r["op"] for r in doc["records"]} == set(bench.OPS)
    for r in doc["records"]:
        assert r["tokens"] == 16 and r["model"] == "gpt_oss"
        for v in bench.OVERHEAD_VARIANTS:
            assert math.isfinite(r[f"us_{v}"]) and r[f"us_{v}"] > 0, (r["op"], v)


def test_target_checks_follow_the_issue_targets():
    """Backward ops: roofline, 4x eager, 1.5x compile; forward: roofline, 1x compile; the gating
    top-k forward has no roofline target; a record without compile has no compile check. The
    roofline target is TARGET_ROOF of the streaming roof (roof_frac), or TARGET_COPY of the
    copy bandwidth for a record of a run without the roof."""
    def rec(op, roof, eag, cmp_):
        return dict(op=op, model="m", dtype="bf16", shape=dict(T=bench.TARGET_TOKENS),
                    roofline_frac=roof, speedup_eager=eag, speedup_compile=cmp_, gbps=1.0,
                    copy_gbps=2.0, ms_kernel=1.0)

    tc = bench.target_checks
    assert tc(rec("moe_init_routing_grad", 0.71, 4.1, 1.49)) == dict(
        roofline=True, eager=True, compile=False)
    assert tc(rec("moe_finalize_routing_grad", 0.69, 3.9, 1.5)) == dict(
        roofline=False, eager=False, compile=True)
    assert tc(rec("swiglu_group", 0.70, 0.5, 1.0)) == dict(roofline=True, eager=None,
                                                             compile=True)
    assert tc(rec("moe_init_routing", 0.9, 9.0, 0.99)) == dict(roofline=True, eager=None,
                                                                compile=False)
    assert tc(rec("moe_gating_top_k", 0.01, 1.0, None)) == dict(roofline=None, eager=None,
                                                                 compile=None)
    md = bench.targets_markdown([rec("moe_init_routing_grad", 0.71, 4.1, 1.49),
                                 rec("moe_gating_top_k", 0.01, 1.0, None)])
    assert "1.49× ✗" in md and "compute (" in md and "2 of 3 target checks met." in md
    assert "ceiling" not in md  # no compile time in these records: no ceiling to give
    # with the streaming roof, roof_frac decides, whatever the copy fraction
    assert bench.TARGET_ROOF == 0.80 and bench.TARGET_COPY == 0.70
    new = dict(rec("swiglu_group", 1.2, 0.5, 1.0), roof_frac=0.79, read_gbps=9.0,
               write_gbps=7.0)
    assert tc(new)["roofline"] is False
    assert tc(dict(new, roofline_frac=0.5, roof_frac=0.8))["roofline"] is True
    md = bench.targets_markdown([new, dict(rec("moe_gating_top_k", 0.01, 1.0, None),
                                           cycles_per_token=1234.4)])
    assert "| 0.79 ✗ |" in md and "9.0 / 7.0" in md and "1234 cycles/token" in md


def test_compile_ceiling_is_the_window_s_best_possible_ratio():
    """A vs-compile miss shows the largest ratio its window allowed: compile's time over the
    bytes at 1.0 of the copy plus the public op's cost beyond its kernel."""
    r = dict(op="moe_init_routing_grad", model="m", dtype="bf16",
             shape=dict(T=bench.TARGET_TOKENS), roofline_frac=0.9, speedup_eager=50.0,
             speedup_compile=1.4, gbps=1.0, copy_gbps=25.0, bytes=500_000_000,
             ms_kernel=22.0, ms_moegrad=26.0, ms_compile=36.4)
    # floor 500 MB / 25 GB/s = 20 ms, plus 4 ms beyond the kernel: 36.4 / 24 = 1.5167
    assert bench.compile_ceiling(r) == pytest.approx(36.4 / 24.0)
    assert "1.40× ✗ (ceiling 1.52×)" in bench.targets_markdown([r])
    r2 = dict(r, ms_moegrad=21.0)  # public op faster than its kernel: no negative cost
    assert bench.compile_ceiling(r2) == pytest.approx(36.4 / 20.0)
    assert bench.compile_ceiling(dict(r, ms_compile=None)) is None
    met = dict(r, speedup_compile=1.6)
    assert "ceiling" not in bench.targets_markdown([met])


def test_probe_in_cache_measures_the_roofline_misses(monkeypatch):
    """Only records at TARGET_TOKENS that miss the roofline target get an in-cache rate: the
    same case at T halved until it moves <= IN_CACHE_LLC_FRACTION x LLC, its kernel timed on
    one buffer set; compute-bound when that time is above the streaming roof of its bytes /
    TARGET_ROOF (records without the roof: its rate below TARGET_COPY x the reference copy)."""
    T = bench.TARGET_TOKENS

    def rec(op, roof):
        return dict(op=op, model="gpt_oss", dtype="bf16", shape=dict(T=T), roofline_frac=roof,
                    speedup_eager=9.0, speedup_compile=9.0, gbps=1.0, copy_gbps=2.0,
                    ms_kernel=1.0)

    miss, met = rec("swiglu_group", 0.5), rec("moe_finalize_routing", 0.9)
    exempt = rec("moe_gating_top_k", 0.01)
    llc = 32 << 20
    timed = []

    def fake_time(methods, budget, probe, rounds):
        (fns,) = methods.values()
        fns[0]()  # the real native call on the small case
        timed.append(len(fns))
        return {"kernel": 1e-3}, []

    monkeypatch.setattr(bench.ops, "time_interleaved", fake_time)
    bench.probe_in_cache([miss, met, exempt], llc, bench.Budget(), 1, ref_copy=80.0)
    assert timed == [1] and "in_cache" not in met and "in_cache" not in exempt
    c = miss["in_cache"]
    limit = int(bench.IN_CACHE_LLC_FRACTION * llc)
    assert c["bytes"] <= limit < bench.build_case("swiglu_group", "gpt_oss", "bf16",
                                                   2 * c["T"]).bytes
    assert c["gbps"] == pytest.approx(c["bytes"] / 1e-3 / 1e9)
    assert c["compute_bound"] == (c["gbps"] < bench.TARGET_COPY * 80.0)
    md = bench.targets_markdown([miss, met])
    assert f"(T={c['T']}" in md and "In cache:" in md
    # with the roof's bandwidths: 1 ms for the in-cache bytes is compute-bound against a
    # roof of 1e6 GB/s and memory-bound against 1e-3 GB/s
    for bw, bound in ((1e6, True), (1e-3, False)):
        r = dict(rec("swiglu_group", 0.5), roof_frac=0.5, read_gbps=bw, write_gbps=bw)
        bench.probe_in_cache([r], llc, bench.Budget(), 1, ref_copy=80.0)
        assert r["in_cache"]["compute_bound"] is bound


def test_probe_same_size_copy_times_the_misses_against_a_copy_of_their_bytes(monkeypatch):
    """Only roofline misses at TARGET_TOKENS get a same-size copy: the kernel over the record's
    n_sets buffer sets and a copy_ of the case's bytes (2 x size) through as many buffer pairs,
    timed in one window; kernel_frac = kernel GB/s / copy GB/s; shown in the targets table."""
    T = bench.TARGET_TOKENS

    def rec(op, model, roof):
        return dict(op=op, model=model, dtype="bf16", shape=dict(T=T), roofline_frac=roof,
                    speedup_eager=9.0, speedup_compile=9.0, gbps=1.0, copy_gbps=2.0,
                    ms_kernel=1.0, n_sets=3)

    miss = rec("moe_gating_top_k_backward", "gpt_oss", 0.5)
    met = rec("moe_gating_top_k_backward", "deepseek_v3", 0.9)
    exempt = rec("moe_gating_top_k", "gpt_oss", 0.01)
    seen = []

    def fake_time(methods, budget, probe, rounds):
        assert set(methods) == {"kernel", "copy"} and probe is None
        seen.append({k: len(v) for k, v in methods.items()})
        methods["kernel"][0]()  # the real native call
        methods["copy"][1]()    # a real copy
        return {"kernel": 2e-5, "copy": 1e-5}, []

    monkeypatch.setattr(bench.ops, "time_interleaved", fake_time)
    bench.probe_same_size_copy([miss, met, exempt], 32 << 20, bench.Budget(), 1)
    assert seen == [dict(kernel=3, copy=3)]
    assert "same_size_copy" not in met and "same_size_copy" not in exempt
    c = miss["same_size_copy"]
    case = bench.build_case("moe_gating_top_k_backward", "gpt_oss", "bf16", T)
    assert case.bytes - 8 < c["bytes"] <= case.bytes and c["n_sets"] == 3
    assert c["gbps"] == pytest.approx(c["bytes"] / 1e-5 / 1e9)
    assert c["kernel_gbps"] == pytest.approx(case.bytes / 2e-5 / 1e9)
    assert c["kernel_frac"] == pytest.approx(c["kernel_gbps"] / c["gbps"])
    md = bench.targets_markdown([miss, met])
    assert f"| {c['gbps']:.1f} (kernel {c['kernel_frac']:.2f}) |" in md
    assert "Same-size copy:" in md


def test_same_size_copies_move_the_bytes():
    """Each call copies nbytes / 2 into its own buffer (counted 2 x size), one pair per set."""
    calls = bench.same_size_copies(1000, 4)
    assert len(calls) == 4
    dst = calls[2].func.__self__
    src = calls[2].args[0]
    assert dst.numel() * 8 == 1000 and src.data_ptr() != dst.data_ptr()
    assert len({c.func.__self__.data_ptr() for c in calls}) == 4
    calls[2]()
    assert bool((dst == 1.0).all())


# ---------------------------------------------------------------------------------------------
# the streaming roof (bench/roof.py)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 1000, 4099])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_stream_probes_read_write_and_copy_every_element(n, offset):
    # Any length and alignment: the probes stream whole aligned vectors and do the ragged ends
    # with plain loads and stores, on 1 and 3 threads.
    src = torch.arange(n + offset + 8, dtype=torch.float32) % 61 - 30.0
    for threads in (1, 3):
        with roof._threads(threads):
            s = roof._C._stream_read(src.data_ptr() + 4 * offset, n)
            assert s == float(src[offset:offset + n].double().sum())
            dst = torch.full((n + offset + 8,), float("nan"))
            roof._C._stream_write(dst.data_ptr() + 4 * offset, n, 2.5)
            assert torch.equal(dst[offset:offset + n], torch.full((n,), 2.5))
            assert dst[:offset].isnan().all() and dst[offset + n:].isnan().all()
            dst.fill_(float("nan"))
            roof._C._stream_copy(src.data_ptr() + 4 * offset, dst.data_ptr() + 4 * offset, n)
            assert torch.equal(dst[offset:offset + n], src[offset:offset + n])
            assert dst[:offset].isnan().all() and dst[offset + n:].isnan().all()


def test_stream_probe_measures_every_kind_on_its_threads():
    before = (moegrad._C.get_num_threads(), torch.get_num_threads())
    p = roof.StreamProbe(threads=2, llc=1 << 16, min_bytes=1 << 20)
    s = p.measure(reps=2)
    assert set(s) == set(roof.KINDS)
    assert all(math.isfinite(v) and v > 0 for v in s.values()), s
    assert (moegrad._C.get_num_threads(), torch.get_num_threads()) == before
    assert torch.equal(p.dst, p.src)  # the copy ran last but one, after the write


def test_roof_time_splits_reads_and_writes():
    a, b, out = torch.empty(10), torch.empty(3, dtype=torch.bfloat16), torch.empty(4)
    # a tensor passed twice counts once; attributes are skipped
    assert roof.split_bytes((a, b, 7, a, out), (out,)) == (46, 16)
    bw = dict(read=2.0, write=0.5)
    assert roof.roof_seconds(4e9, 1e9, bw) == pytest.approx(2.0 + 2.0)
    # a copy of N bytes at 2 N / copy seconds against its roof N / read + N / write
    assert roof.copy_on_roof(dict(read=2.0, write=0.5, copy=1.6)) == pytest.approx(2.5 / 1.25)


def test_clock_and_cycles_per_token():
    ghz = roof.clock_ghz(n=200_000, reps=3)
    assert 0.2 < ghz < 10.0, ghz          # a real core's clock, whatever the load
    assert roof.cycles_per_token(2.0, 1000, 2, 3.0) == pytest.approx(2e-3 * 3e9 * 2 / 1000)
    assert roof.cycles_per_token(2.0, 0, 2, 3.0) is None
