"""The streaming roof of ``moegrad.bench`` (docs/performance.md, "Streaming roof").

What the machine streams on the benchmark's thread count, measured in the same run (and the
same time window) as the kernels it bounds, with moegrad's own probes (``moegrad._C``):

* ``read``: the sum of an fp32 buffer (``_stream_read``), bytes = its size;
* ``write``: the buffer filled with non-temporal stores where the CPU has them, as the
  kernels store large outputs (``_stream_write``), bytes = its size;
* ``copy``: buffer to buffer with non-temporal stores (``_stream_copy``), 2 x size;
* ``torch_copy``: ``Tensor.copy_`` of the same buffers, 2 x size: the reference of the copy
  fraction the benchmark reported before (``roofline_frac``), kept beside the roof for one
  release.

An op's roof time is its read bytes / read bandwidth + its write bytes / write bandwidth
(:func:`roof_seconds`); ``roof_frac`` = roof time / kernel time. A kernel that reads and
writes at the same time can beat neither stream alone, so 1.0 is the ceiling of a kernel whose
traffic is its compulsory bytes.

The gating forward's top-k is compute-bound: its roof is counted in core cycles per token
(:func:`cycles_per_token`), with the clock measured by a chain of dependent additions
(:func:`clock_ghz`, one addition per cycle).
"""
from __future__ import annotations

import statistics
import time
from typing import Dict, Iterable, Optional, Tuple

import torch
from torch import Tensor

from moegrad import _C

# Bandwidths one probe sample reports, GB/s.
KINDS = ("read", "write", "copy", "torch_copy")


def _threads(n: int):
    """Context: moegrad and torch on n threads, restored afterwards."""
    class _T:
        def __enter__(self):
            self.old = (_C.get_num_threads(), torch.get_num_threads())
            _C.set_num_threads(n)
            torch.set_num_threads(n)

        def __exit__(self, *exc):
            _C.set_num_threads(self.old[0])
            torch.set_num_threads(self.old[1])
    return _T()


class StreamProbe:
    """One buffer pair of max(min_bytes, 4 x LLC) fp32, kept for the whole run; each
    :meth:`measure` gives the median of `reps` timings of every kind (GB/s, :data:`KINDS`),
    taken one after the other, so the four numbers of a sample share one time window."""

    def __init__(self, threads: int, llc: int, min_bytes: int = 128 << 20):
        self.threads = threads
        self.nbytes = max(min_bytes, 4 * llc) // 64 * 64
        self.n = self.nbytes // 4
        self.src = torch.empty(self.n, dtype=torch.float32).fill_(1.0)
        self.dst = torch.empty_like(self.src).fill_(0.0)

    def _calls(self):
        s, d, n = self.src.data_ptr(), self.dst.data_ptr(), self.n
        return {
            "read": (lambda: _C._stream_read(s, n), self.nbytes),
            "write": (lambda: _C._stream_write(d, n, 2.0), self.nbytes),
            "copy": (lambda: _C._stream_copy(s, d, n), 2 * self.nbytes),
            "torch_copy": (lambda: self.dst.copy_(self.src), 2 * self.nbytes),
        }

    def measure(self, reps: int = 5) -> Dict[str, float]:
        out = {}
        with _threads(self.threads):
            for kind, (fn, nbytes) in self._calls().items():
                fn()  # untimed lead-in
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                out[kind] = nbytes / statistics.median(times) / 1e9
        return out


def median_sample(samples: Iterable[Dict[str, float]]) -> Dict[str, float]:
    """Per kind, the median over probe samples."""
    samples = list(samples)
    return {k: statistics.median(s[k] for s in samples) for k in KINDS if samples
            and all(k in s for s in samples)}


def split_bytes(native_args: tuple, native_outputs: tuple) -> Tuple[int, int]:
    """(read bytes, write bytes) of one native call: every tensor argument that is not an
    output is read once, every output written once (the bench's BYTES model)."""
    outs = {id(t) for t in native_outputs if isinstance(t, Tensor)}
    seen = set()
    read = write = 0
    for a in native_args:
        if not isinstance(a, Tensor) or id(a) in seen:
            continue
        seen.add(id(a))
        nbytes = a.numel() * a.element_size()
        if id(a) in outs:
            write += nbytes
        else:
            read += nbytes
    return read, write


def roof_seconds(read_bytes: int, write_bytes: int, bw: Dict[str, float]) -> float:
    """The roof time: read bytes at the read bandwidth plus write bytes at the write one."""
    return read_bytes / (bw["read"] * 1e9) + write_bytes / (bw["write"] * 1e9)


def copy_on_roof(bw: Dict[str, float]) -> float:
    """The probe's own copy as a fraction of the roof of its bytes (a read and a write of the
    buffer): above 1.0 where reads and writes overlap, i.e. what an op that reads and writes at
    once may reach."""
    return (1.0 / bw["read"] + 1.0 / bw["write"]) / (2.0 / bw["copy"])


def clock_ghz(n: int = 1_000_000, reps: int = 51) -> float:
    """The calling core's clock, GHz: 8 n dependent additions (one per cycle), the fastest of
    `reps` short reps (about 2 ms each: time taken from the thread by other processes only
    ever lengthens a rep, and a short one often runs whole on a busy machine)."""
    _C._dependent_adds(n // 10)  # lead-in: the core leaves any idle state
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _C._dependent_adds(n)
        times.append(time.perf_counter() - t0)
    return 8 * n / min(times) / 1e9


def cycles_per_token(ms: float, tokens: int, threads: int, ghz: float) -> Optional[float]:
    """Core cycles per token of a call of `ms` milliseconds over `tokens` tokens on `threads`
    cores at `ghz`."""
    if tokens <= 0:
        return None
    return ms * 1e-3 * ghz * 1e9 * threads / tokens
