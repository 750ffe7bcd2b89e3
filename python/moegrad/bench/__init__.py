"""moegrad benchmark: every operator at real MoE model shapes, against PyTorch eager and
torch.compile of the same formula, with bytes moved, achieved bandwidth and roofline fraction.

    python -m moegrad.bench                      # full run (tens of minutes on 2 cores)
    python -m moegrad.bench --quick              # about a minute
    python -m moegrad.bench --json docs/perf.json --plot docs/perf.png
    python -m moegrad.bench --ops swiglu_group_quant_backward --models deepseek_v3 --tokens 4096
    python -m moegrad.bench --from-json a.json,b.json --markdown results.md   # re-render, merge
    python -m moegrad.bench --overhead --threads 1  # per-call cost at T=16
    python -m moegrad.bench --layer                 # the MoE layer (moegrad.bench.layer)
    python -m moegrad.bench --hf                    # transformers MoE blocks (moegrad.bench.hf)
    python -m moegrad.bench --device cuda           # the CUDA backend (moegrad.bench.cuda)

Modules: ops (cases, byte counts, timing, the per-case run, the overhead mode), report (summary,
targets, markdown, plot, JSON, --from-json), layer (--layer), cuda (--device cuda). This module
holds the command line.

Method (details in docs/performance.md):
* Per case (operator x model x dtype x token count) the inputs are built once, then cloned into
  ``n_sets`` buffer sets whose total size exceeds the last-level cache (four times over), and
  successive calls rotate through the sets, so a call does not find its data in cache
  (``cold`` in the record says whether the rotation reached 2 x LLC; the tiniest cases are
  capped at MAX_SETS sets and are warm, they measure call overhead anyway).
* Four timings, same run, same threads, median over calls after warm-up:
  ``ms_moegrad`` the public function (``moegrad.<op>``: custom-op dispatch, output allocation,
  the kernel); ``ms_kernel`` the native call ``moegrad._C.<op>`` into preallocated, rotating
  outputs; ``ms_eager`` the plain-PyTorch formula of ``moegrad.reference_torch``;
  ``ms_compile`` ``torch.compile`` (inductor, static shapes) of that same formula. The four
  are interleaved in rounds with samples of the streaming roof (``time_interleaved``,
  ``roof.StreamProbe``), so every ratio of a record compares numbers taken in the same window
  of time.
* ``bytes``: each input read once plus each output written once (BYTES table below), split
  into ``read_bytes`` and ``write_bytes``. ``roof_frac`` = ``ms_roof`` / ms_kernel, where
  ``ms_roof`` = read_bytes / ``read_gbps`` + write_bytes / ``write_gbps``, the medians of the
  case's samples of a read-only sum and a write-only fill (non-temporal stores) of a 128 MB
  buffer (at least 4 x LLC) on the same threads (roof.py). ``gbps`` = bytes / ms_kernel and
  ``roofline_frac`` = gbps / ``copy_gbps``, the samples' ``Tensor.copy_`` of that buffer
  counted as 2 x size: the copy fraction reported before the roof, kept beside it. The gating
  forward (compute-bound) reports ``cycles_per_token`` at the measured ``clock_ghz``. The VM's bandwidth has slow and fast phases
  (42 to 80 GB/s on the development machine): cases whose window fell below 0.85 x the run's
  reference (the highest of the cases' copy bandwidths) are measured again at the end of the
  run, up to twice (within half the run's time), and the attempt with the highest copy
  bandwidth is kept (``attempts``, ``copy_low``; ``remeasure_low_copy``).
* Before timing, each case is checked once: moegrad's outputs against the eager formula (and
  the compiled one against eager) with ``torch.testing.assert_close``; a mismatch is reported in
  the table and in the record's ``check`` field, and makes the exit status 1.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from typing import List, Tuple

import torch

import moegrad

from . import roof
from .ops import (BACKWARD_OPS, BYTES, DEFAULT_MEM_LIMIT_GB, DTYPES, FULL_TOKENS,  # noqa: F401
                  HEADER, IN_CACHE_LLC_FRACTION, LOW_COPY, MAX_SETS, MODELS, OPS,
                  OVERHEAD_VARIANTS, REMEASURE, ROOF_EXEMPT, TARGET_COPY, TARGET_ROOF,
                  TARGET_TOKENS, Budget, Case, CaseData, StreamProbe, build_case, check_outputs, clone_set,
                  copy_bandwidth_gbps, estimate_memory, format_row, in_cache_tokens, llc_bytes,
                  mirror_ops, n_sets_for, probe_in_cache, probe_same_size_copy,
                  remeasure_low_copy, roofline_misses, run_case, run_overhead, same_size_copies,
                  select_cases, target_checks, tensors_nbytes, time_interleaved)
from .report import (compile_ceiling, load_records, make_plot, markdown_table,  # noqa: F401
                     print_summary, progress, report, summarize, targets_markdown,
                     write_outputs)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m moegrad.bench", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="write {meta, records[]} as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of roofline fraction per op/size")
    p.add_argument("--markdown", metavar="PATH", help="write the results as markdown tables")
    p.add_argument("--from-json", metavar="PATH[,PATH...]", type=lambda s: s.split(","),
                   help="measure nothing: load earlier --json files (later files replace the "
                   "same cases of earlier ones) and print / write the table, plot, markdown")
    p.add_argument("--quick", action="store_true", help="a subset that runs in about a minute")
    p.add_argument("--overhead", action="store_true",
                   help="per-call time of each public op at T=16 (gpt_oss, bf16) against eager, "
                   "with both torch.library registration styles (custom_op, Library)")
    p.add_argument("--tiny", action="store_true",
                   help="smallest smoke run (T=1,16; bf16; short timing) for tests")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="threads for moegrad, eager and compile (default: available cores)")
    p.add_argument("--ops", type=lambda s: s.split(","), default=list(OPS),
                   help="comma-separated operator names (default: all of them)")
    p.add_argument("--models", type=lambda s: s.split(","), default=None,
                   help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=None,
                   help="comma-separated subset of fp32,bf16,fp16 (default fp32,bf16)")
    p.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=None,
                   help=f"comma-separated token counts (default {FULL_TOKENS})")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu (default) or cuda: the GPU benchmark of moegrad.bench.cuda")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--seed", type=int, default=None, help="input seed (default: random, printed)")
    p.add_argument("--mem-limit-gb", type=float, default=DEFAULT_MEM_LIMIT_GB,
                   help="skip cases estimated above this footprint (default %(default)s)")
    p.add_argument("--max-sets", type=int, default=MAX_SETS, help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, default=None,
                   help="timing budget per method per case (default 0.25; quick 0.1)")
    args = p.parse_args(argv)
    bad = [o for o in args.ops if o not in OPS]
    if bad:
        p.error(f"unknown op(s) {bad}; choose from {', '.join(OPS)}")
    if args.models and any(m not in MODELS for m in args.models):
        p.error(f"unknown model in {args.models}; choose from {', '.join(MODELS)}")
    if args.dtypes and any(d not in DTYPES for d in args.dtypes):
        p.error(f"unknown dtype in {args.dtypes}; choose from {', '.join(DTYPES)}")
    if args.threads < 1:
        p.error("--threads must be >= 1")
    return args




def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--layer" in argv:
        from .layer import main as layer_main
        return layer_main(argv)
    if "--hf" in argv:
        from .hf import main as hf_main
        return hf_main(argv)
    args = parse_args(argv)
    if args.from_json:
        return report(args)
    if args.device == "cuda":
        from . import cuda
        return cuda.main(args)
    if args.seed is None:
        args.seed = int.from_bytes(os.urandom(4), "little")
    if args.overhead:
        prev = (torch.get_num_threads(), moegrad.get_num_threads())
        try:
            return run_overhead(args)
        finally:
            torch.set_num_threads(prev[0])
            moegrad.set_num_threads(prev[1])
    budget = Budget(seconds=args.seconds if args.seconds is not None
                    else (0.03 if args.tiny else 0.1 if args.quick else 0.25))
    if args.tiny:
        budget.min_calls, budget.max_calls, args.max_sets = 3, 50, min(args.max_sets, 4)

    prev_torch_threads = torch.get_num_threads()
    prev_moegrad_threads = moegrad.get_num_threads()
    t_start = time.time()
    try:
        torch.set_num_threads(args.threads)
        moegrad.set_num_threads(args.threads)
        llc, llc_src = llc_bytes()
        copy_gbps = copy_bandwidth_gbps(args.threads, llc)
        # --tiny checks the machinery, not the machine: small probe buffers
        probe = StreamProbe(args.threads, 0, 4 << 20) if args.tiny else StreamProbe(args.threads,
                                                                                    llc)
        roof_start = probe.measure()
        mem_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        meta = dict(
            date=datetime.datetime.now().isoformat(timespec="seconds"),
            moegrad=moegrad.__version__, torch=torch.__version__, python=platform.python_version(),
            cpu=platform.processor() or platform.machine(), cores=os.cpu_count(),
            threads=args.threads, llc_bytes=llc, llc_source=llc_src, copy_gbps=copy_gbps,
            roof_start=roof_start, clock_ghz=roof.clock_ghz(),
            mem_total_gb=mem_total / 2**30, mem_limit_gb=args.mem_limit_gb, seed=args.seed,
            mode="tiny" if args.tiny else "quick" if args.quick else "full",
            loadavg_start=os.getloadavg()[0],
            thp_mem_alloc_enable=os.environ.get("THP_MEM_ALLOC_ENABLE"),
            bytes_definition={op: BYTES[op][0] for op in OPS}, skipped=[])
        print(f"moegrad {meta['moegrad']} | torch {meta['torch']} | {meta['cores']} cores, "
              f"threads={args.threads} | LLC {llc / 2**20:.0f} MiB ({llc_src}) | "
              f"RAM {meta['mem_total_gb']:.0f} GiB | copy bandwidth {copy_gbps:.1f} GB/s | "
              f"seed {args.seed} | load average {meta['loadavg_start']:.2f}")
        print(f"streaming roof: read {roof_start['read']:.1f}, write {roof_start['write']:.1f}, "
              f"copy {roof_start['copy']:.1f} GB/s (Tensor.copy_ {roof_start['torch_copy']:.1f}; "
              f"the copy at {roof.copy_on_roof(roof_start):.2f} of the roof); "
              f"clock {meta['clock_ghz']:.2f} GHz")
        print(f"cases above ~{args.mem_limit_gb:g} GB estimated footprint are skipped "
              f"(this machine has {meta['mem_total_gb']:.0f} GiB and {meta['cores']} cores). "
              "Times in ms (median); moegrad = public op, kernel = _C call into preallocated "
              "outputs; GB/s from kernel; roof = streaming roof time / kernel time, copyf = "
              "GB/s / copy; speedups = eager or compile / moegrad.")
        if meta["loadavg_start"] > 0.5:
            print(f"warning: load average {meta['loadavg_start']:.2f} before the run: other "
                  "processes compete for the cores; timings will be noisy")
        print(HEADER)
        sys.stdout.flush()
        records: List[dict] = []
        cases_run: List[Tuple[Case, bool]] = []
        failures = 0
        rounds = 2 if args.tiny else 4
        selected = select_cases(args)
        for number, (case, comp) in enumerate(selected):
            progress(number, len(selected), f"{case.op} {case.model} {case.dtype} "
                     f"T={case.tokens}", t_start)
            n_sets = n_sets_for(case.bytes, llc, args.max_sets)
            est = estimate_memory(case, n_sets, with_eager=True)
            if est > args.mem_limit_gb * 1e9:
                reason = f"~{est / 1e9:.1f} GB estimated > {args.mem_limit_gb:g} GB limit"
                meta["skipped"].append(dict(op=case.op, model=case.model, dtype=case.dtype,
                                            T=case.tokens, reason=reason))
                print(f"{case.op:<28} {case.model:<12} {case.dtype:<4} {case.tokens:>6} "
                      f"{case.desc:<30} skipped: {reason}")
                continue
            try:
                rec = run_case(case, args, llc, copy_gbps, args.seed, comp, budget, probe,
                               rounds)
            except Exception as e:  # noqa: BLE001 - a failing case must not end the run
                msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
                meta.setdefault("errors", []).append(dict(op=case.op, model=case.model,
                                                          dtype=case.dtype, T=case.tokens,
                                                          error=msg))
                print(f"{case.op:<28} {case.model:<12} {case.dtype:<4} {case.tokens:>6} "
                      f"{case.desc:<30} ERROR {msg}")
                failures += 1
                continue
            rec["attempts"] = 1
            cases_run.append((case, comp))
            records.append(rec)
            failures += rec["check"] != "ok"  # a compile-baseline problem is only reported
            print(format_row(rec) + ("" if rec["check_compile"] in (None, "ok")
                                     else f" [compile: {rec['check_compile']}]"))
            sys.stdout.flush()
        # re-measuring may add at most half the run's time (and at least a minute)
        remeasure_low_copy(records, cases_run, args, llc, budget, probe, rounds, meta,
                           budget_s=max(60.0, 0.5 * (time.time() - t_start)))
        if records:
            probe_in_cache(records, llc, budget, args.seed, meta["copy_gbps_reference"])
            probe_same_size_copy(records, llc, budget, args.seed, rounds)
        meta["summary"] = summarize(records)
        if records:
            print_summary(meta["summary"])
        meta["roof_end"] = probe.measure()
        del probe
        copy_end = copy_bandwidth_gbps(args.threads, llc)
        meta["copy_gbps_end"] = copy_end
        meta["loadavg_end"] = os.getloadavg()[0]
        meta["wall_s"] = time.time() - t_start
        if abs(copy_end - copy_gbps) > 0.2 * copy_gbps:
            print(f"warning: copy bandwidth changed during the run ({copy_gbps:.1f} -> "
                  f"{copy_end:.1f} GB/s): the machine is probably busy; timings are noisy")
        print(f"{len(records)} cases, {len(meta['skipped'])} skipped, {failures} failures, "
              f"{meta['wall_s']:.0f} s; copy bandwidth at end {copy_end:.1f} GB/s, "
              f"load average {meta['loadavg_end']:.2f}")
        write_outputs(meta, records, args)
        return 1 if failures else 0
    finally:
        torch.set_num_threads(prev_torch_threads)
        moegrad.set_num_threads(prev_moegrad_threads)
