#!/usr/bin/env python3
"""Prints the ptxas resource table of the CUDA kernels (docs/cuda.md): registers, spill stores and
loads, stack frame and static shared memory per kernel, for one architecture (default sm_90).

    python3 scripts/ptxas_table.py [--arch 90] [--build build/cuda]

Compiles each CUDA source with the build tree's own command (ninja -t commands; the tree must be
configured with MOEGRAD_WITH_CUDA=ON) plus -Xptxas -v, to /dev/null; needs nvcc, no GPU.
"""
import argparse
import re
import subprocess
import sys


def demangle(names):
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                             check=True).stdout.splitlines()
        return out if len(out) == len(names) else names
    except (OSError, subprocess.CalledProcessError):
        return names


def short(name):
    name = re.sub(r"moegrad::cuda::\(anonymous namespace\)::", "", name)
    name = re.sub(r"moegrad::|cub::[A-Za-z_:0-9]*::", "", name)
    name = re.sub(r"\(.*\)$", "", name)
    return name[:70]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="90")
    ap.add_argument("--build", default="build/cuda")
    a = ap.parse_args()
    cmds = subprocess.run(["ninja", "-C", a.build, "-t", "commands", "moegrad_objects"],
                          capture_output=True, text=True, check=True).stdout.splitlines()
    rows = []
    for c in cmds:
        m = re.search(r" -c (\S+\.cu) ", c)
        if not m:
            continue
        src = m.group(1)
        c = re.sub(r'"?--generate-code=[^ ]*', "", c)
        c = re.sub(r" -o \S+", " -o /dev/null", c).replace("ccache ", "")
        c = re.sub(r" -MD -MT \S+ -MF \S+", "", c)
        c += f" -gencode=arch=compute_{a.arch},code=sm_{a.arch} -Xptxas -v"
        r = subprocess.run(c, shell=True, capture_output=True, text=True)
        if r.returncode != 0:
            sys.stderr.write(r.stderr)
            sys.exit(r.returncode)
        fn = None
        for line in r.stderr.splitlines():
            m = re.search(r"Compiling entry function '(\S+)'", line)
            if m:
                fn = m.group(1)
                cur = {"src": src.split("/src/")[-1], "fn": fn, "regs": "?", "smem": "0",
                       "stack": "0", "spill": "0/0"}
                rows.append(cur)
            m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                          line)
            if m and fn:
                cur["stack"], cur["spill"] = m.group(1), f"{m.group(2)}/{m.group(3)}"
            m = re.search(r"Used (\d+) registers", line)
            if m and fn:
                cur["regs"] = m.group(1)
                s = re.search(r"(\d+) bytes smem", line)
                cur["smem"] = s.group(1) if s else "0"
    names = demangle([r["fn"] for r in rows])
    print(f"| source | kernel (sm_{a.arch}) | registers | spill st/ld (B) | stack (B) | static smem (B) |")
    print("| --- | --- | --- | --- | --- | --- |")
    seen = set()
    for r, n in zip(rows, names):
        key = (r["src"], short(n), r["regs"], r["smem"])
        if key in seen:
            continue
        seen.add(key)
        print(f"| {r['src']} | `{short(n)}` | {r['regs']} | {r['spill']} | {r['stack']} | {r['smem']} |")


if __name__ == "__main__":
    main()
