"""moegrad: fused Mixture-of-Experts training operators for PyTorch, on CPUs and NVIDIA GPUs.

Every function takes and returns torch.Tensors, is a ``torch.library`` custom op in the
namespace ``moegrad`` (``torch.ops.moegrad.<name>``, with a fake kernel for torch.compile), and
raises :class:`MoeError` (``.code`` = aclnn status) on invalid input. Every forward is
differentiable through its backward operator. Signatures: docs/operators.md §7.2;
semantics, shapes, dtypes and status codes: docs/operators.md; decisions: docs/decisions.md.
"""
from __future__ import annotations

# torch before the native module: the front needs it anyway, and its CUDA libraries then load
# first, as they do when a user imports torch before moegrad.
import torch  # noqa: F401

from . import _C
from ._errors import MoeError

_C._set_error_class(MoeError)

from . import ops  # noqa: E402
from .ops import *  # noqa: E402,F401,F403  (the public ops: their list is ops.__all__)

__version__ = "0.1.0"

__all__ = ["MoeError", *ops.__all__, "set_num_threads", "get_num_threads"]


def set_num_threads(n: int) -> None:
    """CPU threads of the kernels: n >= 1, or 0 for the OpenMP default. Results do not depend
    on it (D16). A negative n raises MoeError 161002 (docs/decisions.md L173)."""
    _C.set_num_threads(n)


def get_num_threads() -> int:
    """CPU threads the kernels use."""
    return _C.get_num_threads()


from . import nn  # noqa: E402,F401  (moegrad.nn.MoE; uses the functions above)
