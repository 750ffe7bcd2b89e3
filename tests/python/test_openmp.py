"""One OpenMP runtime per PyTorch process (docs/performance.md "Threads: one OpenMP runtime",
docs/decisions.md L85): moegrad's parallel regions run on the libgomp that torch loaded, so the
two never keep two spinning thread pools on the same cores. Likewise one C++ runtime: the
module links the shared libstdc++ (L219)."""
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


def test_set_num_threads_refuses_a_negative_count():
    """n = 0 means the OpenMP default; a negative count is refused, and the setting is kept
    (docs/decisions.md L173)."""
    import moegrad

    before = moegrad._C.get_num_threads()
    moegrad.set_num_threads(3)
    try:
        for bad in (-3, -1):
            with pytest.raises(moegrad.MoeError, match=rf"set_num_threads: n: .*; got {bad}$") \
                    as info:
                moegrad.set_num_threads(bad)
            assert info.value.code == 161002
            assert moegrad.get_num_threads() == 3
        with pytest.raises(TypeError):
            moegrad.set_num_threads(2.5)
        moegrad.set_num_threads(0)                   # the OpenMP default
        assert moegrad.get_num_threads() >= 1
    finally:
        moegrad.set_num_threads(before)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF shared libraries")
def test_native_module_uses_the_shared_cpp_runtime():
    """The module links the shared libstdc++ (docs/decisions.md L219): a second, static copy
    beside the one torch loads crashed iostreams on a GPU machine."""
    import shutil

    import moegrad
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("needs readelf (binutils)")
    out = subprocess.run([readelf, "-d", moegrad._C.__file__], capture_output=True, text=True,
                         check=True).stdout
    needed = [ln.split("[")[-1].rstrip("]") for ln in out.splitlines() if "(NEEDED)" in ln]
    assert "libstdc++.so.6" in needed, needed
