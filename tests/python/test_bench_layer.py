"""Smoke test of `python -m moegrad.bench --layer` (no timing is asserted)."""
import json
import math

import pytest
import torch

from moegrad import bench
from moegrad.bench.layer import TorchMoELayer, make_layer


def test_layer_benchmark_smoke(tmp_path, capsys):
    out = tmp_path / "layer.json"
    rc = bench.main(["--layer", "--quick", "--no-compile", "--dtypes", "fp32,bf16", "--reps", "1",
                     "--threads", "1", "--tokens", "64", "--json", str(out)])
    assert rc == 0
    err = capsys.readouterr().err                     # progress before each configuration
    assert "[1/2] layer deepseek_v3 fp32 H=128 F=64 E=16 K=4 T=64 (" in err, err
    assert "[2/2] layer deepseek_v3 bf16 " in err and " left)" in err, err
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


@pytest.mark.parametrize("arch", ["deepseek_v3", "gpt_oss"])
def test_layer_benchmark_baseline_computes_the_same_layer(arch, seed):
    """The plain-torch baseline the layer is timed against computes what moegrad.nn.MoE computes
    (output and every gradient, fp32), so the benchmark compares equal work."""
    torch.manual_seed(seed)
    m = make_layer(arch, 32, 16, 16, 4)
    ref = TorchMoELayer(m)
    x = torch.randn(64, 32)
    g = torch.randn(64, 32)          # random upstream gradient
    outs = []
    for layer in (m, ref):
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.backward(g)
        outs.append([y.detach(), xi.grad] + [p.grad.clone() for p in m.parameters()
                                             if p.grad is not None])
        m.zero_grad(set_to_none=True)
    assert len(outs[0]) == len(outs[1]) > 2
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_layer_benchmark_gpt_oss_smoke(tmp_path, capsys):
    out = tmp_path / "layer.json"
    rc = bench.main(["--layer", "--arch", "gpt_oss", "--quick", "--no-compile", "--dtypes",
                     "bf16", "--reps", "1", "--threads", "1", "--tokens", "64", "--json",
                     str(out)])
    assert rc == 0
    assert "[1/1] layer gpt_oss bf16 H=128 F=64 E=16 K=4 T=64 (" in capsys.readouterr().err
    (r,) = json.loads(out.read_text())["records"]
    assert r["arch"] == "gpt_oss" and r["moegrad_ms"] > 0 and r["eager_ms"] > 0
