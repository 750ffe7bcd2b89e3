"""`python -m moegrad.bench --hf`: one forward + backward of the MoE block of transformers
architectures, moegrad.hf against transformers' own experts backends (docs/hf.md,
docs/performance.md "transformers MoE blocks").

For each architecture and dtype, in one run and on the same block (same weights, input and
upstream gradient):
* moegrad: moegrad.hf.apply (router and experts);
* transformers "eager" (its per-expert loop), "grouped_mm" (its default), and torch.compile of
  the faster of those two;
* the step times of grouped_mm, its compile and moegrad measured in interleaved rounds (one
  model per backend, sharing the weight tensors), so that a drift of the machine reaches all
  three alike;
* the in-step split of each step into the expert GEMMs and everything else (CPU: the
  profiler's time of the outermost GEMM ops inside the real step, the router's GEMMs counted as
  non-GEMM, as in the layer benchmark), and the peak memory of a step;
* CPU: the expert GEMMs' floating-point operations in the step, the GEMM rate each backend
  reaches inside it, and "x eager ceiling": eager's step over the time those GEMMs alone take
  at the rate of torch.mm on a large square product, measured in the same run (L229), the most
  any backend that runs the same GEMMs could gain over eager;
* a step is the block's forward and backward; freeing the weight gradients it left (an
  optimizer's zero_grad) runs after it, untimed (_Step.reset, L224).
Shapes are scaled from the real models (H, I, E, K below; T tokens, default 512 so that the
whole run fits a small machine).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import math
import os
import sys
from typing import Dict, List

import torch

import moegrad
from moegrad.nn.moe import _like_layout

from .layer import _gemm_rate, _in_step_split, _interleaved, _peak_bytes, _time

# arch -> (H, I, E, K, what it is scaled from)
SHAPES = {
    "qwen3_moe": (2048, 768, 128, 8, "Qwen3-30B-A3B (H=2048, I=768, E=128, K=8)"),
    "qwen2_moe": (2048, 1408, 60, 4, "Qwen1.5-MoE-A2.7B (H=2048, I=1408, E=60, K=4, shared 5632)"),
    "olmoe": (2048, 1024, 64, 8, "OLMoE-1B-7B (H=2048, I=1024, E=64, K=8)"),
    "mixtral": (2048, 7168, 8, 2, "Mixtral-8x7B (H=4096, I=14336, E=8, K=2) at half width"),
    "deepseek_v3": (2048, 1024, 64, 8, "DeepSeek-V3 scaled (H=7168, I=2048, E=256, K=8, "
                                       "8 groups keep 4)"),
    "gpt_oss": (2880, 2880, 32, 4, "GPT-OSS-20B (H=2880, I=2880, E=32, K=4)"),
    "deepseek_v4": (2048, 1024, 64, 6, "DeepSeek-V4 scaled (sqrt-softplus router, clamp 10)"),
}
QUICK = (64, 32, 8, 2)
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _block(arch: str, H: int, I_: int, E: int, K: int, dtype, device):
    """(model, its first top-k-routed MoE block): a one-MoE-layer model of `arch`, random init."""
    import transformers as tf

    import moegrad.hf as mh
    cfg = mh.small_config(arch, hidden=H, intermediate=I_, experts=E, top_k=K, layers=1,
                          heads=max(H // 128, 2))
    model = tf.AutoModelForCausalLM.from_config(cfg, experts_implementation="grouped_mm")
    model = model.to(device=device, dtype=dtype).train()
    return model, _find_block(model)


def _shared_copy(model):
    """A copy of model whose parameters are model's own tensors (no weight is copied), so that
    each backend can keep its own modules while all of them compute on the same weights."""
    return copy.deepcopy(model, memo={id(p): p for p in model.parameters()})


def _find_block(model):
    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts") and not getattr(layer.mlp, "is_hash", False):
            return layer.mlp
    raise RuntimeError(f"{type(model).__name__}: no top-k MoE block")


class _Step:
    """One forward + backward of block `mod` on x with upstream gradient g: calling it is the
    timed step. reset() frees the weight gradients it left, as an optimizer's
    zero_grad(set_to_none=True) does; the timers call it after every step, outside the timed
    and profiled region (layer._settle): releasing the gradient memory is neither forward nor
    backward work, costs every backend the same, and was 6.6 ms of a 90 ms Qwen3-MoE fp32 step."""

    def __init__(self, mod, x, g):
        self.mod, self.x, self.g = mod, x, g

    def __call__(self):
        xi = self.x.detach().requires_grad_(True)
        y = self.mod(xi)
        (y[0] if isinstance(y, tuple) else y).backward(self.g)

    def reset(self):
        self.mod.zero_grad(set_to_none=True)


def _case(arch: str, H: int, I_: int, E: int, K: int, T: int, dtype, device: str, seed: int):
    """(model, step, record) of one configuration: the seeded block, a step builder on its
    random input and upstream gradient [1, T, H], and the record's identifying fields."""
    torch.manual_seed(seed)
    model, _ = _block(arch, H, I_, E, K, dtype, device)
    x = torch.randn(1, T, H, device=device, dtype=dtype)
    g = torch.randn(1, T, H, device=device, dtype=dtype)
    res: Dict = dict(arch=arch, H=H, I=I_, E=E, K=K, T=T, device=device,
                     dtype=str(dtype).replace("torch.", ""))
    return model, functools.partial(_Step, x=x, g=g), res


def _router_shapes(T: int, H: int, E: int):
    """Operand shapes (first two) of the router's GEMMs: the forward (mm, or addmm with the
    router bias first, GPT-OSS) and its two backward products. The in-step split counts them
    as non-GEMM."""
    return {((T, H), (H, E)), ((E,), (T, H)), ((T, E), (E, H)), ((E, T), (T, H))}


def run_config(arch: str, H: int, I_: int, E: int, K: int, T: int, dtype, device: str,
               reps: int, compile_best: bool = True, seed: int = 0) -> Dict:
    import moegrad.hf as mh
    model, step, res = _case(arch, H, I_, E, K, T, dtype, device, seed)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    router = _router_shapes(T, H, E)
    # One model per backend, all on the same weight tensors.
    models = {}
    for impl in ("eager", "grouped_mm"):
        models[impl] = _shared_copy(model)
        models[impl].set_experts_implementation(impl)
    models["moegrad"] = _shared_copy(model)
    report = mh.apply(models["moegrad"])
    res["patched"] = [f"{e.kind}: {e.detail}" for e in report.patched]
    res["left_alone"] = [f"{e.kind}: {e.detail}" for e in report.left_alone]
    fns = {n: step(_find_block(m)) for n, m in models.items()}
    # transformers' eager loop (seconds per step at some shapes) is timed on its own; the
    # faster transformers backend, its compile and moegrad in interleaved rounds.
    res["eager_ms"] = _time(fns["eager"], reps, sync) * 1e3
    timed = {"grouped_mm": fns["grouped_mm"], "moegrad": fns["moegrad"]}
    if compile_best:
        torch._dynamo.reset()
        timed["compile"] = step(torch.compile(_find_block(models["grouped_mm"])))
    ms = _interleaved(timed, reps, sync)
    for n, v in ms.items():
        res[f"{n}_ms"] = v * 1e3
    if compile_best and res["eager_ms"] < res["grouped_mm_ms"]:
        # eager is the faster transformers backend: compile that one instead
        torch._dynamo.reset()
        res["compile_ms"] = _time(step(torch.compile(_find_block(models["eager"]))), reps,
                                  sync) * 1e3
    res["best_transformers"] = min(("eager", "grouped_mm"), key=lambda n: res[f"{n}_ms"])
    for n in ("eager", "grouped_mm", "moegrad"):
        if device == "cpu":
            sp = _in_step_split(fns[n], reps, router)
            res[f"{n}_non_gemm_ms"] = sp["non_gemm_ms"]
            res[f"{n}_gemm_ms"] = sp["gemm_ms"]
            res[f"{n}_gemm_gflop"] = sp["gemm_gflop"]
        res[f"{n}_peak_mb"] = _peak_bytes(fns[n], device) / 2**20
    fastest = min(res[f"{n}_ms"] for n in ("eager", "grouped_mm", "compile") if f"{n}_ms" in res)
    res["speedup_vs_eager"] = res["eager_ms"] / res["moegrad_ms"]
    res["speedup_vs_best"] = fastest / res["moegrad_ms"]
    if "moegrad_non_gemm_ms" in res:
        res["non_gemm_speedup_vs_grouped_mm"] = (res["grouped_mm_non_gemm_ms"]
                                                 / res["moegrad_non_gemm_ms"])
    res["peak_ratio_vs_grouped_mm"] = res["moegrad_peak_mb"] / res["grouped_mm_peak_mb"]
    if device == "cpu" and res["moegrad_gemm_gflop"] > 0:
        # L229: the expert GEMMs alone, at the rate torch.mm reaches on a large square product,
        # estimate the most any backend running them can gain over eager
        res["gemm_tflops_square"] = _gemm_rate(dtype) * 1e-12
        floor_ms = res["moegrad_gemm_gflop"] / res["gemm_tflops_square"]
        res["eager_ceiling"] = res["eager_ms"] / floor_ms
        for n in ("eager", "moegrad"):
            res[f"{n}_gemm_tflops"] = res[f"{n}_gemm_gflop"] / res[f"{n}_gemm_ms"]
    return res


STUB_EVENT = "moegrad.bench::stub_gemm"


class _StubGemm(torch.autograd.Function):
    """Stands in for an expert GEMM (--stub-gemms): the output and the input gradient with the
    shapes the real one gives, filled with 0.5 (what the GEMM would write, without its
    arithmetic; uninitialised memory would feed denormals and NaNs to the next operator), inside
    a profiler range that the split counts as GEMM time; the weight and bias gradients, which no
    operator of the step reads, allocated in the real one's layout and left unwritten."""

    @staticmethod
    def forward(ctx, a, b, bias):
        ctx.a_shape, ctx.has_bias = a.shape, bias is not None
        ctx.b_meta = torch.empty_strided(b.shape, b.stride(), device="meta")  # its layout
        ctx.gbias_shape = None if bias is None else bias.shape
        with torch.profiler.record_function(STUB_EVENT):
            return a.new_empty((a.shape[0], b.shape[-1])).fill_(0.5)

    @staticmethod
    def backward(ctx, g):
        gbias = g.new_empty(ctx.gbias_shape) if ctx.has_bias else None
        with torch.profiler.record_function(STUB_EVENT):
            ga = g.new_empty(ctx.a_shape).fill_(0.5)
        # a fresh tensor that only autograd holds: AccumulateGrad takes it without a copy
        return ga, _like_layout(g, ctx.b_meta), gbias


@contextlib.contextmanager
def _stubbed_expert_gemms():
    """Every expert GEMM of both backends (transformers' grouped-GEMM dispatcher, torch's grouped
    GEMM, which it and moegrad.hf call, and moegrad.nn.grouped_mm) replaced by _StubGemm; the
    router's and the shared experts' GEMMs stay real."""
    import torch.nn.functional as F
    import transformers.integrations.moe as tm

    import moegrad.hf as mh

    def grouped(a, b, offs=None, bias=None, out_dtype=None):
        return _StubGemm.apply(a, b, bias)

    def moegrad_grouped(x, w, counts, host_counts=None, bias=None):
        return _StubGemm.apply(x, w, bias)
    # transformers' own dispatcher too: on an older torch it routes to its per-expert fallback
    # op, which the torch-level patches would not reach.
    targets = [(F, "grouped_mm", grouped), (torch, "_grouped_mm", grouped),
               (tm, "_grouped_mm", grouped), (mh, "_TORCH_GROUPED_MM", grouped),
               (mh, "grouped_mm", moegrad_grouped)]
    targets = [(mod, name, fn) for mod, name, fn in targets if hasattr(mod, name)]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in targets]
    try:
        for mod, name, fn in targets:
            setattr(mod, name, fn)
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def run_stub_config(arch: str, H: int, I_: int, E: int, K: int, T: int, dtype, reps: int,
                    seed: int = 0) -> Dict:
    """CPU: the in-step non-GEMM split of grouped_mm and moegrad as run_config measures it, and
    the same with every expert GEMM stubbed out (_stubbed_expert_gemms): what is left is each
    backend's own non-GEMM work, without what the real GEMMs cost the rest of the step (the
    caches they flush, the large outputs they fill)."""
    import moegrad.hf as mh
    model, step, res = _case(arch, H, I_, E, K, T, dtype, "cpu", seed)
    router = _router_shapes(T, H, E)
    models = {"grouped_mm": _shared_copy(model), "moegrad": _shared_copy(model)}
    models["grouped_mm"].set_experts_implementation("grouped_mm")
    mh.apply(models["moegrad"])
    for n, m in models.items():
        f = step(_find_block(m))
        f()
        f.reset()
        res[f"{n}_non_gemm_ms"] = _in_step_split(f, reps, router)["non_gemm_ms"]
        with _stubbed_expert_gemms():
            f()
            f.reset()
            res[f"{n}_own_non_gemm_ms"] = _in_step_split(f, reps, router,
                                                         STUB_EVENT)["non_gemm_ms"]
    res["non_gemm_speedup_vs_grouped_mm"] = (res["grouped_mm_non_gemm_ms"]
                                             / res["moegrad_non_gemm_ms"])
    res["own_non_gemm_speedup_vs_grouped_mm"] = (res["grouped_mm_own_non_gemm_ms"]
                                                 / res["moegrad_own_non_gemm_ms"])
    return res


STUB_HEADER = ("| arch | dtype | T | non-GEMM ms moegrad / grouped_mm | x non-GEMM | "
               "GEMMs stubbed: non-GEMM ms moegrad / grouped_mm | x |")


def stub_row(r: Dict) -> str:
    return (f"| {r['arch']} | {r['dtype']} | {r['T']} | {r['moegrad_non_gemm_ms']:.1f} / "
            f"{r['grouped_mm_non_gemm_ms']:.1f} | {r['non_gemm_speedup_vs_grouped_mm']:.2f} | "
            f"{r['moegrad_own_non_gemm_ms']:.1f} / {r['grouped_mm_own_non_gemm_ms']:.1f} | "
            f"{r['own_non_gemm_speedup_vs_grouped_mm']:.2f} |")


HEADER = ("| arch | dtype | T | moegrad ms | eager ms | grouped_mm ms | compile ms | "
          "x eager | x eager ceiling | x best | non-GEMM ms moegrad / grouped_mm | x non-GEMM | peak MB moegrad / "
          "grouped_mm |")


def row(r: Dict) -> str:
    def f(k, fmt="{:.1f}"):
        v = r.get(k)
        return "-" if v is None else fmt.format(v)
    return (f"| {r['arch']} | {r['dtype']} | {r['T']} | {f('moegrad_ms')} | {f('eager_ms')} | "
            f"{f('grouped_mm_ms')} | {f('compile_ms')} | {f('speedup_vs_eager', '{:.2f}')} | "
            f"{f('eager_ceiling', '{:.2f}')} | "
            f"{f('speedup_vs_best', '{:.2f}')} | {f('moegrad_non_gemm_ms')} / "
            f"{f('grouped_mm_non_gemm_ms')} | {f('non_gemm_speedup_vs_grouped_mm', '{:.2f}')} |"
            f" {f('moegrad_peak_mb', '{:.0f}')} / {f('grouped_mm_peak_mb', '{:.0f}')} |")


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m moegrad.bench --hf",
                                description="Time one forward + backward of transformers MoE "
                                            "blocks: moegrad.hf vs eager, grouped_mm, compile.")
    p.add_argument("--hf", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--archs", default=",".join(SHAPES),
                   help="comma-separated architectures")
    p.add_argument("--tokens", type=int, default=512, help="T")
    p.add_argument("--scale", type=int, default=1,
                   help="divide H and I by this (a slow or busy machine); E and K stay")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help=f"tiny shapes (H, I, E, K = {QUICK}, T=64, 1 rep): a smoke test")
    p.add_argument("--stub-gemms", action="store_true",
                   help="CPU: only the non-GEMM split of grouped_mm and moegrad, with the real "
                        "expert GEMMs and with them stubbed out")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--markdown", metavar="PATH", help="write the table as markdown")
    a = p.parse_args(argv)
    if a.stub_gemms and a.device != "cpu":
        p.error("--stub-gemms: the split is measured on the CPU (--device cpu)")
    archs = a.archs.split(",")
    unknown = [x for x in archs if x not in SHAPES]
    if unknown:
        p.error(f"--archs: unknown {unknown}; choose from {', '.join(SHAPES)}")
    if a.quick:
        a.tokens, a.reps = 64, 1
    prev = (torch.get_num_threads(), moegrad.get_num_threads())
    torch.set_num_threads(a.threads)
    moegrad.set_num_threads(a.threads)
    records = []
    try:
        header = STUB_HEADER if a.stub_gemms else HEADER
        fmt = stub_row if a.stub_gemms else row
        print(header)
        print("|" + "---|" * (header.count("|") - 1))
        for arch in archs:
            H, I_, E, K, _ = SHAPES[arch]
            H, I_ = H // a.scale, I_ // a.scale
            if a.quick:
                H, I_, E, K = QUICK
            for name in a.dtypes.split(","):
                if a.stub_gemms:
                    r = run_stub_config(arch, H, I_, E, K, a.tokens, _DTYPES[name], a.reps)
                else:
                    r = run_config(arch, H, I_, E, K, a.tokens, _DTYPES[name], a.device,
                                   a.reps, compile_best=not a.no_compile)
                records.append(r)
                print(fmt(r))
                sys.stdout.flush()
    finally:
        torch.set_num_threads(prev[0])
        moegrad.set_num_threads(prev[1])
    meta = dict(torch=torch.__version__, threads=a.threads, device=a.device, tokens=a.tokens,
                scale=a.scale,
                shapes={k: SHAPES[k][4] for k in archs})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(meta=meta, records=records), f, indent=2)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(header + "\n" + "|" + "---|" * (header.count("|") - 1) + "\n")
            f.write("\n".join(fmt(r) for r in records) + "\n")
    key = "moegrad_own_non_gemm_ms" if a.stub_gemms else "moegrad_ms"
    bad = [r for r in records if not math.isfinite(r[key])]
    return 1 if bad else 0
