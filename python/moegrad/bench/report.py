"""Rendering of the benchmark's records: the per-op summary and target checks, the markdown
tables, the plot, the JSON file, and the re-rendering of earlier --json files (--from-json)."""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from .ops import (DTYPES, HEADER, IN_CACHE_LLC_FRACTION, MODELS, OPS, ROOF_EXEMPT,
                  TARGET_COMPILE_BWD, TARGET_COMPILE_FWD, TARGET_COPY, TARGET_EAGER_BWD,
                  TARGET_ROOF, TARGET_TOKENS, _fmt_frac, _fmt_ms, _fmt_x, format_row,
                  target_checks)


def _fmt_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def progress(done: int, total: int, what: str, t_start: float, stream=None) -> str:
    """Before each case of a run: one line on stderr (the table stays on stdout) with the case's
    number, what it measures, the time spent and, from the mean time per case so far, roughly
    how long the rest takes. Returns the line."""
    elapsed = time.time() - t_start
    left = f", ~{_fmt_duration(elapsed / done * (total - done))} left" if done else ""
    line = f"[{done + 1}/{total}] {what} ({_fmt_duration(elapsed)} elapsed{left})"
    print(line, file=stream if stream is not None else sys.stderr, flush=True)
    return line


def summarize(records: List[dict]) -> List[dict]:
    """Per op and dtype, the largest case run (most bytes): the numbers the targets speak of."""
    best: Dict[Tuple[str, str], dict] = {}
    for r in records:
        key = (r["op"], r["dtype"])
        if key not in best or r["bytes"] > best[key]["bytes"]:
            best[key] = r
    rows = []
    for op in OPS:
        for dt in DTYPES:
            r = best.get((op, dt))
            if r is None:
                continue
            rows.append(dict(op=op, dtype=dt, model=r["model"], T=r["shape"]["T"],
                             bytes=r["bytes"], roofline_frac=r["roofline_frac"],
                             roof_frac=r.get("roof_frac"),
                             cycles_per_token=r.get("cycles_per_token"),
                             speedup_eager=r["speedup_eager"],
                             speedup_compile=r["speedup_compile"],
                             ms_moegrad=r["ms_moegrad"], ms_kernel=r["ms_kernel"],
                             ms_compile=r["ms_compile"]))
    return rows


def compile_ceiling(r: dict) -> Optional[float]:
    """The public-op-vs-compile ratio the record's window allowed, were the public op's kernel
    at exactly the window's copy bandwidth (a read-mostly loop reaches 1.0-1.1 of the copy on
    the development machine: `stream_read_sum` in moegrad_bench_kernels, docs/decisions.md
    L142): ms_compile / (bytes / copy + the public op's measured cost beyond its kernel, i.e.
    output allocation and first touch, which compile's fresh output pays too). None without a
    compile time."""
    if r.get("ms_compile") is None or not r.get("copy_gbps"):
        return None
    floor_ms = r["bytes"] / (r["copy_gbps"] * 1e9) * 1e3
    return r["ms_compile"] / (floor_ms + max(0.0, r["ms_moegrad"] - r["ms_kernel"]))


def targets_markdown(records: List[dict]) -> str:
    """One row per case at TARGET_TOKENS: each target's figure and whether it is met."""
    rows = [r for r in records if r["shape"]["T"] == TARGET_TOKENS]
    if not rows:
        return ""
    lines = [f"Targets at T = {TARGET_TOKENS} (≥ {TARGET_ROOF:.2f} of the streaming roof, "
             f"or ≥ {TARGET_COPY:.2f} of the copy bandwidth for a run without it; the gating "
             f"top-k forward is compute-bound and reports cycles per token; backward ≥ "
             f"{TARGET_EAGER_BWD:g}× eager and ≥ {TARGET_COMPILE_BWD:g}× compile; forward ≥ "
             f"{TARGET_COMPILE_FWD:g}× compile); ✗ marks a miss:", "",
             "| op | model | dtype | kernel GB/s | read / write GB/s | roof | copy GB/s "
             "| copy fraction | vs eager | vs compile | in cache GB/s | same-size copy GB/s |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    met = total = 0
    for r in rows:
        t = target_checks(r)
        met += sum(v is True for v in t.values())
        total += sum(v is not None for v in t.values())

        def cell(text, ok):
            return text if ok is None or ok else f"{text} ✗"
        if r["op"] in ROOF_EXEMPT:
            roof = f"compute ({1e6 * r['ms_kernel'] / r['shape']['T']:.0f} ns/token"
            if r.get("cycles_per_token") is not None:
                roof += f", {r['cycles_per_token']:.0f} cycles/token"
            roof += ")"
        elif r.get("roof_frac") is not None:
            roof = cell(f"{r['roof_frac']:.2f}", t["roofline"])
        else:
            roof = "–"
        copy_frac = f"{r['roofline_frac']:.2f}"
        if r.get("roof_frac") is None and r["op"] not in ROOF_EXEMPT:
            copy_frac = cell(copy_frac, t["roofline"])
        rw = ("–" if r.get("read_gbps") is None
              else f"{r['read_gbps']:.1f} / {r['write_gbps']:.1f}")
        cmp_ = r.get("speedup_compile")
        eag = cell(f"{r['speedup_eager']:.1f}×", t["eager"])
        cmp_txt = "–" if cmp_ is None else cell(f"{cmp_:.2f}×", t["compile"])
        ceiling = compile_ceiling(r) if t["compile"] is False else None
        if ceiling is not None:
            cmp_txt += f" (ceiling {ceiling:.2f}×)"
        low = "*" if r.get("copy_low") else ""
        c = r.get("in_cache")
        cache = "" if c is None else (f"{c['gbps']:.1f} (T={c['T']}"
                                      + (", compute-bound)" if c["compute_bound"] else ")"))
        sc = r.get("same_size_copy")
        same = "" if sc is None else f"{sc['gbps']:.1f} (kernel {sc['kernel_frac']:.2f})"
        lines.append(f"| {r['op']} | {r['model']} | {r['dtype']} | {r['gbps']:.1f} | {rw} | "
                     f"{roof} | {r['copy_gbps']:.1f}{low} | {copy_frac} | {eag} | {cmp_txt} | "
                     f"{cache} | {same} |")
    lines += ["", f"{met} of {total} target checks met."]
    if any(r.get("in_cache") for r in rows):
        lines += ["", "In cache: a roofline miss's kernel on one buffer set at the largest "
                  f"halving of T that moves at most {IN_CACHE_LLC_FRACTION:g} × LLC (its "
                  "compute alone); compute-bound where that time is still above the "
                  f"streaming roof of its bytes / {TARGET_ROOF:.2f} (runs without the roof: "
                  f"its rate below {TARGET_COPY:.2f} × the run's reference copy bandwidth)."]
    if any(target_checks(r)["compile"] is False for r in rows):
        lines += ["", "Ceiling (a vs-compile miss): compile's time over the public op's least "
                  "possible time in that window, i.e. its bytes at 1.0 of the window's copy "
                  "bandwidth plus its measured cost beyond the kernel (output allocation and "
                  "first touch, which compile's own output pays as well). Below the target, "
                  "the kernel would have had to beat the copy bandwidth."]
    if any(r.get("same_size_copy") for r in rows):
        lines += ["", "Same-size copy: `Tensor.copy_` of a miss's bytes per call through as "
                  "many buffer sets, interleaved with the kernel in one window; in brackets the "
                  "kernel's rate of that window as a fraction of the copy's."]
    return "\n".join(lines) + "\n"


def print_summary(rows: List[dict]) -> None:
    print("\nlargest case per op and dtype (targets for backward ops at large shapes, 2 threads: "
          f"roof >= {TARGET_ROOF:.2f}, >= 4x eager, >= 1.5x compile; copyf = the copy fraction):")
    print(f"{'op':<28} {'dt':<4} {'model':<12} {'T':>6} {'MB':>9} {'roof':>5} {'copyf':>5} "
          f"{'vs eag':>7} "
          f"{'vs cmp':>7} {'moegrad':>9} {'kernel':>9} {'compile':>9}")
    for r in rows:
        print(f"{r['op']:<28} {r['dtype']:<4} {r['model']:<12} {r['T']:>6} "
              f"{r['bytes'] / 1e6:>9.1f} {_fmt_frac(r.get('roof_frac')):>5} "
              f"{r['roofline_frac']:>5.2f} {_fmt_x(r['speedup_eager']):>7} {_fmt_x(r['speedup_compile']):>7} "
              f"{_fmt_ms(r.get('ms_moegrad')):>9} {_fmt_ms(r.get('ms_kernel')):>9} "
              f"{_fmt_ms(r.get('ms_compile')):>9}")


def make_plot(records: List[dict], path: str, meta: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [o for o in OPS if any(r["op"] == o for r in records)]
    cols = min(3, max(1, len(ops)))
    rows = math.ceil(len(ops) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.9 * rows), squeeze=False)
    for ax, op in zip(axes.flat, ops):
        series: Dict[Tuple[str, str], List[Tuple[int, float]]] = {}
        for r in records:
            if r["op"] == op:
                series.setdefault((r["model"], r["dtype"]), []).append(
                    (r["bytes"], r["roofline_frac"] if r.get("roof_frac") is None
                     else r["roof_frac"]))
        for (model, dt), pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts],
                    marker="o" if dt == "bf16" else "s",
                    linestyle="-" if dt == "bf16" else "--", label=f"{model} {dt}")
        ax.axhline(0.7, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xscale("log")
        ax.set_title(op, fontsize=10)
        ax.set_xlabel("bytes moved per call")
        ax.set_ylabel("achieved / copy bandwidth")
        ax.set_ylim(bottom=0)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(ops):]:
        ax.axis("off")
    runs = meta.get("merged_from") or [meta]
    fig.suptitle(f"moegrad roofline fraction ({meta['threads']} threads, copy "
                 + ", ".join(f"{m['copy_gbps']:.1f}" for m in runs) + " GB/s; "
                 + ", ".join(m["date"] for m in runs) + ")", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _record_key(r: dict) -> Tuple[str, str, str, int]:
    return (r["op"], r["model"], r["dtype"], r["shape"]["T"])


def _record_order(r: dict):
    op, model, dt, t = _record_key(r)
    return (OPS.index(op) if op in OPS else 99, list(MODELS).index(model) if model in MODELS
            else 99, t, list(DTYPES).index(dt) if dt in DTYPES else 99)


def load_records(paths: Sequence[str]) -> Tuple[dict, List[dict]]:
    """Merge the records of earlier --json files; a later file's case replaces an earlier one."""
    merged: Dict[Tuple[str, str, str, int], dict] = {}
    metas = []
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        metas.append(doc["meta"])
        for r in doc["records"]:
            merged[_record_key(r)] = dict(r, run=len(metas) - 1)
    meta = dict(metas[0])
    if len(metas) > 1:
        meta["merged_from"] = [dict(path=p, date=m["date"], copy_gbps=m["copy_gbps"],
                                    copy_gbps_end=m.get("copy_gbps_end"),
                                    roof_start=m.get("roof_start"), roof_end=m.get("roof_end"),
                                    clock_ghz=m.get("clock_ghz"),
                                    loadavg_start=m.get("loadavg_start"),
                                    loadavg_end=m.get("loadavg_end"))
                               for p, m in zip(paths, metas)]
    done = set(merged)
    meta["skipped"] = [sk for m in metas for sk in m.get("skipped", [])
                       if (sk["op"], sk["model"], sk["dtype"], sk["T"]) not in done]
    records = sorted(merged.values(), key=_record_order)
    meta["summary"] = summarize(records)
    return meta, records


def markdown_table(meta: dict, records: List[dict]) -> str:
    """The results as markdown: the largest case per op and dtype, then every case."""
    def x(v):
        return "–" if v is None else f"{v:.1f}×"

    def ms(v):
        return "–" if v is None else _fmt_ms(v)

    runs = meta.get("merged_from") or [meta]
    lines = [f"{meta['threads']} threads; copy bandwidth "
             + ", ".join(f"{m['copy_gbps']:.1f} GB/s (start) / "
                         f"{(m.get('copy_gbps_end') or float('nan')):.1f} GB/s (end), "
                         f"run of {m['date']}" for m in runs)
             + (f"; reference (the best case's window) "
                f"{meta['copy_gbps_reference']:.1f} GB/s" if meta.get("copy_gbps_reference")
                else "")
             + f"; torch {meta['torch']}, moegrad {meta['moegrad']}.", ""]
    for m in runs:
        rs = m.get("roof_start")
        if rs:
            re_ = m.get("roof_end") or {}
            lines += [f"Streaming roof (run of {m['date']}): read {rs['read']:.1f}, write "
                      f"{rs['write']:.1f}, copy {rs['copy']:.1f} GB/s at the start (the copy "
                      f"at {(1 / rs['read'] + 1 / rs['write']) * rs['copy'] / 2:.2f} of the roof)"
                      + (f"; {re_['read']:.1f}, {re_['write']:.1f}, {re_['copy']:.1f} GB/s at "
                         "the end" if re_ else "")
                      + (f"; clock {m['clock_ghz']:.2f} GHz" if m.get("clock_ghz") else "")
                      + ".", ""]
    lines += ["Largest case run per operator and dtype:", "",
             "| op | dtype | model | T | MB | roof | copy fraction | vs eager | vs compile "
             "| moegrad ms | kernel ms | compile ms |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in meta["summary"]:
        lines.append(f"| {r['op']} | {r['dtype']} | {r['model']} | {r['T']} | "
                     f"{r['bytes'] / 1e6:.1f} | {_fmt_frac(r.get('roof_frac'))} | "
                     f"{r['roofline_frac']:.2f} | "
                     f"{x(r['speedup_eager'])} | {x(r['speedup_compile'])} | "
                     f"{ms(r.get('ms_moegrad'))} | {ms(r.get('ms_kernel'))} | "
                     f"{ms(r.get('ms_compile'))} |")
    targets = targets_markdown(records)
    if targets:
        lines += ["", targets.rstrip("\n")]
    lines += ["", "All cases (ms are medians; moegrad = public op, kernel = native call into "
              "preallocated outputs; GB/s, roof and copy fraction from kernel; speedups against "
              "moegrad):",
              "", "| op | model | dtype | T | MB | moegrad ms | kernel ms | eager ms | compile ms "
              "| GB/s | copy GB/s | roof | copy fraction | vs eager | vs compile | check |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in records:
        lines.append(f"| {r['op']} | {r['model']} | {r['dtype']} | {r['shape']['T']} | "
                     f"{r['bytes'] / 1e6:.2f} | {ms(r['ms_moegrad'])} | {ms(r['ms_kernel'])} | "
                     f"{ms(r['ms_eager'])} | {ms(r['ms_compile'])} | {r['gbps']:.1f} | "
                     f"{r['copy_gbps']:.1f}{'*' if r.get('copy_low') else ''} | "
                     f"{_fmt_frac(r.get('roof_frac'))} | "
                     f"{r['roofline_frac']:.2f} | {x(r['speedup_eager'])} | "
                     f"{x(r['speedup_compile'])} | {r['check']} |")
    if any(r.get("copy_low") for r in records):
        lines += ["", "\\* the case's copy bandwidth stayed below 0.85 x the reference after "
                  "re-measuring (the VM's slow phase)."]
    if meta.get("skipped"):
        lines += ["", "Skipped (memory): " + ", ".join(
            f"{sk['op']} {sk['model']} {sk['dtype']} T={sk['T']}" for sk in meta["skipped"])]
    return "\n".join(lines) + "\n"


def write_outputs(meta: dict, records: List[dict], args) -> None:
    for path in (args.json, args.plot, args.markdown):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, records=records), f, indent=1)
    if args.plot and records:
        make_plot(records, args.plot, meta)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown_table(meta, records))


def report(args) -> int:
    """--from-json: re-render (and merge) earlier runs without measuring anything."""
    meta, records = load_records(args.from_json)
    print(HEADER)
    for r in records:
        print(format_row(r))
    print_summary(meta["summary"])
    write_outputs(meta, records, args)
    return 1 if any(r["check"] != "ok" for r in records) else 0
