"""Smoke test of `python -m moegrad.bench --layer` (no timing is asserted)."""
import json
import math

from moegrad import bench


def test_layer_benchmark_smoke(tmp_path, capsys):
    out = tmp_path / "layer.json"
    rc = bench.main(["--layer", "--quick", "--no-compile", "--dtypes", "fp32,bf16", "--reps", "1",
                     "--threads", "1", "--tokens", "64", "--json", str(out)])
    assert rc == 0
    err = capsys.readouterr().err                     # progress before each configuration
    assert "[1/2] layer fp32 H=128 F=64 E=16 K=4 T=64 (" in err, err
    assert "[2/2] layer bf16 " in err and " left)" in err, err
    doc = json.loads(out.read_text())
    assert [r["dtype"] for r in doc["records"]] == ["float32", "bfloat16"]
    for r in doc["records"]:
        for k in ("moegrad_ms", "eager_ms", "gemm_grouped_ms", "gemm_loop_ms",
                  "moegrad_non_gemm_ms", "eager_non_gemm_ms", "speedup_vs_eager",
                  "peak_mb_moegrad", "peak_mb_eager", "moegrad_in_step_gemm_ms",
                  "moegrad_in_step_non_gemm_ms", "eager_in_step_gemm_ms",
                  "eager_in_step_non_gemm_ms", "in_step_non_gemm_speedup_vs_eager"):
            assert isinstance(r[k], float) and math.isfinite(r[k]), (k, r[k])
        assert r["moegrad_ms"] > 0 and r["eager_ms"] > 0 and r["peak_mb_eager"] > 0
        # the profiler found the expert GEMMs inside both steps
        assert r["moegrad_in_step_gemm_ms"] > 0 and r["eager_in_step_gemm_ms"] > 0
