"""Helpers shared by test_validation / test_autograd / test_torch_integration / test_determinism
/ test_execution / test_nn.

Kept separate from conftest.py (owned by the numerical-test suite). Nothing here computes a
kernel result: the helpers poison buffers, snapshot their bytes, match argument names in error
messages, hand out seeded generators and record the operators a dispatch mode sees.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode



# --------------------------------------------------------------------------------- seeding --

@pytest.fixture
def gen(seed):
    """A torch.Generator seeded by conftest's `seed` fixture (os.urandom or MOEGRAD_TEST_SEED,
    printed), so a failing run replays with MOEGRAD_TEST_SEED=<seed>."""
    return torch.Generator().manual_seed(seed)


def randn(g, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(tuple(shape), generator=g, dtype=torch.float64) * scale).to(dtype)


def rand(g, *shape, dtype=torch.float32, lo=0.0, hi=1.0):
    return (lo + (hi - lo) * torch.rand(tuple(shape), generator=g, dtype=torch.float64)).to(dtype)


def randperm(g, n, dtype=torch.int32):
    return torch.randperm(n, generator=g).to(dtype)


def upstream(g, *shape, dtype=torch.float32):
    """A random upstream gradient that is never all ones (nor all equal)."""
    t = torch.randn(tuple(shape), generator=g, dtype=torch.float64)
    if t.numel() > 1:
        t.view(-1)[0] = 0.75  # keeps it from being constant even by chance
    return t.to(dtype)


# --------------------------------------------------------------------------------- poison --

def _is_float(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


def poison(t: torch.Tensor | None) -> None:
    """Fill every byte of `t` with 0xFF (a NaN for floats, -1 for ints); works on any strides."""
    if t is None or t.numel() == 0:
        return
    if t.is_contiguous():
        t.view(-1).view(torch.uint8).fill_(0xFF)
        return
    # Non-contiguous: build the poisoned bits contiguously and copy element-wise (bit-exact
    # because the copy is a same-dtype copy).
    src = torch.empty(t.shape, dtype=t.dtype)
    src.view(-1).view(torch.uint8).fill_(0xFF)
    t.copy_(src)


def snapshot(t: torch.Tensor | None):
    """The bytes of `t` (in logical element order), or None."""
    if t is None:
        return None
    c = t.detach().contiguous().clone()
    return c.view(-1).view(torch.uint8).clone() if c.numel() else c.view(-1).view(torch.uint8)


def same_bytes(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and torch.equal(a, b)


def poison_pattern_count(t: torch.Tensor) -> int:
    """How many elements of `t` still hold the all-0xFF poison pattern."""
    if t.numel() == 0:
        return 0
    b = t.detach().contiguous().view(-1).view(torch.uint8).view(-1, t.element_size())
    return int((b == 0xFF).all(dim=1).sum())


def assert_fully_written(t: torch.Tensor, what: str) -> None:
    n = poison_pattern_count(t)
    assert n == 0, f"{what}: {n} of {t.numel()} elements still hold the poison bytes"


# ------------------------------------------------------------------------- message checks --

def names_argument(msg: str, name: str) -> bool:
    """True if `name` occurs in `msg` as a whole identifier (not inside a longer one)."""
    return re.search(r"(?<![A-Za-z0-9_])" + re.escape(name) + r"(?![A-Za-z0-9_])", msg) is not None


def contains_int(msg: str, value: int) -> bool:
    return re.search(r"(?<![0-9])" + re.escape(str(value)) + r"(?![0-9])", msg) is not None


def assert_names_one_of(msg: str, names) -> None:
    if isinstance(names, str):
        names = (names,)
    assert any(names_argument(msg, n) for n in names), \
        f"error message does not name any of {names!r}: {msg!r}"


# ------------------------------------------------------------------------- tolerances -----

def assert_close_tol(out, ref, dtype=None, what="output", n_reduce=1, scale=None):
    """conftest.assert_close_to_ref (the ONE tolerance table) for a torch float64 reference.

    The default `scale` (magnitude of the terms, see conftest.TOLERANCES) is the largest |ref|
    of the whole tensor: gradients are sums and differences of terms of about that size."""
    import conftest
    r = ref.detach().double()
    if scale is None:
        scale = float(r.abs().max()) if r.numel() else 0.0
    if isinstance(scale, torch.Tensor):
        scale = scale.detach().double().numpy()
    conftest.assert_close_to_ref(out.detach(), r.numpy(), dtype=dtype or out.dtype, scale=scale,
                                 n_reduce=n_reduce, what=what)


# ------------------------------------------------------------------------------ threads ----

class threads:
    """Context manager setting moegrad's CPU thread count, restoring it afterwards."""

    def __init__(self, n):
        self.n = n

    def __enter__(self):
        import moegrad
        self._old = moegrad._C.get_num_threads()
        moegrad._C.set_num_threads(self.n)
        return self

    def __exit__(self, *exc):
        import moegrad
        moegrad._C.set_num_threads(self._old)
        return False


# ------------------------------------------------------------------------------ misc -------

def noncontig(t: torch.Tensor) -> torch.Tensor:
    """A non-contiguous view holding the same values as `t` (same shape and dtype)."""
    assert t.numel() >= 2, "noncontig needs at least two elements"
    if t.dim() >= 2 and t.shape[-1] > 1 and t.shape[-2] > 1:
        out = t.transpose(-1, -2).contiguous().transpose(-1, -2)
    else:
        base = torch.empty(tuple(t.shape[:-1]) + (2 * t.shape[-1],), dtype=t.dtype)
        out = base[..., ::2]
        out.copy_(t)
    assert not out.is_contiguous()
    assert torch.equal(out, t) or (t.is_floating_point() and torch.equal(out.isnan(), t.isnan()))
    return out


# ------------------------------------------------------------------------- dispatch modes --

class OpRecorder(TorchDispatchMode):
    """A dispatch mode that records the name of every operator it sees (in .ops) and runs it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
