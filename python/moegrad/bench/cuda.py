"""GPU benchmark of the CUDA backend: ``python -m moegrad.bench --device cuda``.

Same cases, byte counts and correctness check as the CPU benchmark (moegrad.bench), on one CUDA
device (docs/cuda.md):
* inputs are generated on the device; per case ``n_sets`` buffer sets are cloned so that their
  total size exceeds 2 x L2 (``cold``), and successive calls rotate through them;
* every call is timed with a pair of CUDA events; the median over the timed calls is reported;
* ``gbps`` = bytes moved (each input read once, each output written once) / kernel time, and
  ``roof`` = gbps / the bandwidth of a device-to-device copy (read + write of a buffer of at least
  4 x L2 and 1 GiB) measured with the same events in the same run;
* baselines: the plain-PyTorch formula (moegrad.reference_torch) eager and under torch.compile
  (inductor, static shapes); speedups are baseline time / moegrad kernel time.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import sys
import time
from typing import Dict, List, Sequence

import torch

import moegrad
from moegrad import _C
from . import ops as cpu_bench
from .report import print_summary, summarize  # (the package binds the name report to a function)
from moegrad import reference_torch as ref

GPU_TOKENS = (4096, 16384, 65536)
GPU_MODELS = ("deepseek_v3", "qwen3_moe", "gpt_oss")
CUDA_OPS = cpu_bench.OPS  # every operator has a CUDA kernel
QUICK_PLAN = {"deepseek_v3": (16384, 65536), "qwen3_moe": (16384,), "gpt_oss": (16384,)}


def _time_events(fns: Sequence, warmup: int, calls: int) -> float:
    """Median milliseconds per call over `calls` timed calls (after `warmup`), rotating sets."""
    n = len(fns)
    for i in range(warmup):
        fns[i % n]()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    for i in range(calls):
        starts[i].record()
        fns[(warmup + i) % n]()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def copy_gbps(l2: int) -> float:
    n = max(4 * l2, 1 << 30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = _time_events([lambda: dst.copy_(src)], 3, 20)
    del src, dst
    return 2 * n / (ms * 1e-3) / 1e9


def _clone_sets(base, n: int):
    return [base] + [cpu_bench.clone_set(base) for _ in range(n - 1)]


def run_case(case, l2: int, copy: float, seed: int, do_compile: bool, calls: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.device("cuda"):
        base = case.make(g)
    n_sets = max(2, math.ceil(2.5 * l2 / max(case.bytes, 1)) + 1)
    sets = _clone_sets(base, n_sets)
    api = getattr(moegrad, case.op)
    native = getattr(_C, case.op)
    fwd = cpu_bench.AUTOGRAD_BASELINE.get(case.op)
    eager = cpu_bench.autograd_backward(getattr(ref, fwd)) if fwd else getattr(ref, case.op)
    got = api(*base.api_args, **base.api_kwargs)
    want = eager(*base.ref_args, **base.ref_kwargs)
    check = cpu_bench.check_outputs(case.op, base, got, want)
    del got, want
    ms_kernel = _time_events([lambda d=d: native(*d.native_args) for d in sets], 3, calls)
    ms_api = _time_events([lambda d=d: api(*d.api_args, **d.api_kwargs) for d in sets], 3, calls)
    ms_eager = _time_events([lambda d=d: eager(*d.ref_args, **d.ref_kwargs) for d in sets], 2,
                            max(5, calls // 2))
    ms_compile, check_compile = None, None
    if do_compile:
        try:
            compiled = (cpu_bench.autograd_backward(torch.compile(getattr(ref, fwd),
                                                                  dynamic=False))
                        if fwd else torch.compile(eager, dynamic=False))
            compiled(*base.ref_args, **base.ref_kwargs)
            ms_compile = _time_events([lambda d=d: compiled(*d.ref_args, **d.ref_kwargs)
                                       for d in sets], 2, max(5, calls // 2))
            check_compile = "ok"
        except Exception as e:  # noqa: BLE001 - report and go on
            check_compile = f"compile failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
    gbps = case.bytes / (ms_kernel * 1e-3) / 1e9
    return dict(op=case.op, model=case.model, dtype=case.dtype, shape=case.dims, desc=case.desc,
                bytes=case.bytes, ms_moegrad=ms_api, ms_kernel=ms_kernel, ms_eager=ms_eager,
                ms_compile=ms_compile, gbps=gbps, gbps_api=case.bytes / (ms_api * 1e-3) / 1e9,
                roofline_frac=gbps / copy, speedup_eager=ms_eager / ms_kernel,
                speedup_compile=(ms_compile / ms_kernel) if ms_compile else None,
                copy_gbps=copy, n_sets=n_sets, cold=case.bytes * n_sets >= 2 * l2,
                check=check, check_compile=check_compile, threads=0)


def select(args) -> List:
    if args.tokens or args.models:
        plan = {m: tuple(args.tokens or GPU_TOKENS) for m in (args.models or GPU_MODELS)}
    elif args.quick or args.tiny:
        plan = QUICK_PLAN
    else:
        plan = {m: GPU_TOKENS for m in GPU_MODELS}
    dtypes = args.dtypes or (["bf16"] if (args.quick or args.tiny) else ["bf16", "fp32"])
    ops = [op for op in args.ops if op in CUDA_OPS]
    return [cpu_bench.build_case(op, m, dt, t) for op in ops for m, ts in plan.items()
            if m in cpu_bench.OP_MODELS.get(op, (m,)) for t in ts for dt in dtypes]


def main(args) -> int:
    if not torch.cuda.is_available():
        print("moegrad.bench: --device cuda asked for, but torch sees no CUDA device",
              file=sys.stderr)
        return 2
    if not _C.cuda_built:
        print("moegrad.bench: this moegrad build has no CUDA backend", file=sys.stderr)
        return 2
    if args.seed is None:
        args.seed = 1234
    calls = 10 if (args.quick or args.tiny) else 30
    prop = torch.cuda.get_device_properties(0)
    l2 = int(getattr(prop, "L2_cache_size", 50 << 20))
    copy = copy_gbps(l2)
    t0 = time.time()
    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), device="cuda",
                gpu=prop.name, l2_bytes=l2, copy_gbps=copy, moegrad=moegrad.__version__,
                torch=torch.__version__, seed=args.seed,
                bytes_definition={op: cpu_bench.BYTES[op][0] for op in cpu_bench.OPS})
    print(f"moegrad {meta['moegrad']} | torch {meta['torch']} | {prop.name} | L2 "
          f"{l2 / 2**20:.0f} MiB | device-to-device copy {copy:.0f} GB/s | seed {args.seed}")
    print("Times in ms (median of CUDA-event timings, cold L2); kernel = _C call into "
          "preallocated outputs; GB/s and roof from kernel; speedups = eager or compile / kernel.")
    print(cpu_bench.HEADER)
    records, failures = [], 0

    def save():  # after every case: a run stopped early keeps the finished cases
        if args.json:
            with open(args.json + ".tmp", "w") as f:
                json.dump(dict(meta=meta, records=records), f, indent=1)
            os.replace(args.json + ".tmp", args.json)

    for case in select(args):
        try:
            # --quick compiles one shape per op (compilation dominates its run time)
            comp = not args.no_compile and (not (args.quick or args.tiny) or (
                case.model == "deepseek_v3" and case.tokens == 16384))
            rec = run_case(case, l2, copy, args.seed, comp, calls)
        except torch.cuda.OutOfMemoryError:
            print(f"{case.op:<28} {case.model:<12} {case.dtype:<4} {case.tokens:>6} skipped: OOM")
            torch.cuda.empty_cache()
            continue
        except Exception as e:  # noqa: BLE001 - a failing case must not end the run
            print(f"{case.op:<28} {case.model:<12} {case.dtype:<4} {case.tokens:>6} ERROR "
                  f"{type(e).__name__}: {str(e)[:160]}")
            failures += 1
            continue
        torch.cuda.empty_cache()
        records.append(rec)
        failures += rec["check"] != "ok"
        print(cpu_bench.format_row(rec))
        sys.stdout.flush()
        save()
    meta["summary"] = summarize(records)
    meta["wall_s"] = time.time() - t0
    if records:
        print_summary(meta["summary"])
    print(f"{len(records)} cases, {failures} failures, {meta['wall_s']:.0f} s")
    save()
    return 1 if failures else 0
