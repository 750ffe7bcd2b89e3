"""One OpenMP runtime per PyTorch process (docs/performance.md "Threads: one OpenMP runtime",
docs/decisions.md L85): moegrad's parallel regions run on the libgomp that torch loaded, so the
two never keep two spinning thread pools on the same cores."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import re, torch, moegrad
    torch.set_num_threads(2)
    moegrad.set_num_threads(2)
    x = torch.randn(256, 64)
    moegrad.moe_gating_top_k(x, 4)                       # a moegrad parallel region
    torch.mm(torch.randn(512, 512), torch.randn(512, 512))  # a torch one
    libs = set()
    for line in open("/proc/self/maps"):
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if re.search(r"lib(g|i|)omp[^/]*\\.so", path):
            libs.add(path)
    print("\\n".join(sorted(libs)))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_one_openmp_runtime_in_a_torch_process():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         check=True).stdout.split()
    print("OpenMP runtimes mapped:", out)
    assert len(out) == 1, f"expected one OpenMP runtime in the process, found {out}"
