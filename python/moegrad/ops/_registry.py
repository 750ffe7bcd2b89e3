"""The machinery every operator family module (moegrad/ops/<family>.py) registers with.

``_op("moegrad::<name>")`` turns a Python body into a torch.library operator (schema inferred
from the body's signature, fake kernel and autograd attached with register_fake /
register_autograd); the returned object is the public function. Every operator gets an
Autograd kernel when it is defined: a gradient reaching an operator without a formula raises
MoeError (ERR_NO_KERNEL) instead of coming back None (docs/decisions.md L150); a backward
operator states with ``_op(..., no_double_backward=<why>)`` that it has no formula.

Each op call makes two native calls, the two stages of the C API: ``_C.plan_<op>`` validates
(once), infers the outputs, picks the backend from the tensors' device and sizes the workspace;
Python allocates the outputs and the workspace with torch on the input's device; ``_C.run`` runs
the kernel (without the GIL). See docs/architecture.md.
"""
from __future__ import annotations

import inspect
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .. import _C
from .._errors import ERR_NO_KERNEL, ERR_PARAM_INVALID, MoeError

# DType codes of the native plans (aclDataType values) -> torch dtypes.
_DTYPES = {0: torch.float32, 1: torch.float16, 3: torch.int32, 9: torch.int64,
           27: torch.bfloat16, 35: torch.float8_e5m2, 36: torch.float8_e4m3fn,
           37: torch.float8_e8m0fnu}
# float8 tensors cannot cross DLPack: they are handed to the native run as uint8 views (L26).
_FP8 = (torch.float8_e5m2, torch.float8_e4m3fn, torch.float8_e8m0fnu)


def _contig(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.contiguous()


# Tensors reach the native module as DLPack capsules: torch's C converter is about ten times
# cheaper per tensor than Tensor.__dlpack__, which dominated the call at small sizes. A capsule
# does not keep its tensor alive past the native call, so callers keep the tensors referenced
# (the plan holds their addresses until run).
_dl = torch.utils.dlpack.to_dlpack


def _dlo(t: Optional[Tensor]):
    return None if t is None else _dl(t)


def _execute(planned, like: Tensor) -> List[Tensor]:
    """Stage two: allocate the planned outputs and workspace on like's device, then run."""
    plan, specs, ws_bytes = planned
    dev = like.device
    outs = [torch.empty(shape, dtype=_DTYPES[code], device=dev) for shape, code in specs]
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device=dev) if ws_bytes else None
    stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0
    _C.run(plan, [_dl(o.view(torch.uint8) if o.dtype in _FP8 else o) for o in outs],
           None if ws is None else _dl(ws), stream)
    return outs


def _same_device(op: str, *named) -> None:
    """Fake kernels: every tensor on the first one's device, and that a cpu or cuda one (a real
    meta tensor in eager mode lands here and must fail as the native plan would)."""
    first_name, first = named[0]
    for name, t in named:
        if t is None:
            continue
        if t.device.type not in ("cpu", "cuda"):
            raise MoeError(f"{op}: {name}: tensor must be on cpu or cuda; got {t.device}",
                           ERR_PARAM_INVALID)
        if t.device != first.device:
            raise MoeError(f"{op}: {name}: tensor must be on the device of {first_name} "
                           f"({first.device}); got {t.device}", ERR_PARAM_INVALID)


def _ranks(op: str, code: int, *named) -> None:
    """Fake kernels: each (name, tensor or None, rank) has that rank, or the MoeError the native
    validation raises for it (the fake indexes the shapes next, and an IndexError at trace time
    would name nothing)."""
    for name, t, rank in named:
        if t is not None and t.dim() != rank:
            raise MoeError(f"{op}: {name}: rank must be {rank}; got rank {t.dim()} "
                           f"{list(t.shape)}", code)


# ---------------------------------------------------------------------------------------------
# Registration: torch.library.Library define/impl plus register_fake and register_autograd. Same
# schema and behaviour as torch.library.custom_op, but about 2-3 us cheaper per call
# (docs/performance.md, docs/decisions.md L19); opcheck and torch.compile(fullgraph=True) pass.
# ---------------------------------------------------------------------------------------------
_LIB = torch.library.Library("moegrad", "DEF")
# Every registered operator by name (public and internal), for the benchmark and the tests.
OPS: Dict[str, "_Op"] = {}


class _Op:
    """One operator: defined from its Python body's signature, implemented by the body for every
    device, with register_fake / register_autograd like a custom_op's.

    The Autograd kernel is installed here, once, and calls whatever formula register_autograd
    sets later. Until then (and for good with ``no_double_backward``) a gradient reaching the
    operator raises MoeError ERR_NO_KERNEL naming it (L150). The kernel only runs when the
    dispatcher is used: the direct call (L104) never reaches it, and without a tensor that
    requires grad (grad mode on) it only redispatches."""

    def __init__(self, name: str, fn, no_double_backward: Optional[str] = None):
        self._name, self._init_fn = name, fn
        self._schema = torch.library.infer_schema(fn, mutates_args=())
        self._abstract_fn = self._backward_fn = self._setup_context_fn = None
        # "formula" (register_autograd), "refused" (no_double_backward) or None (undeclared).
        self._grad_kind, self._no_grad_reason = None, no_double_backward
        _LIB.define(name + self._schema)
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        self._qualname = f"moegrad::{name}"
        self._packet = getattr(torch.ops.moegrad, name)
        torch.library.register_autograd(self._qualname, self._autograd_backward,
                                        setup_context=self._autograd_setup, lib=_LIB)
        if no_double_backward is not None:
            self._grad_kind = "refused"
        # The object is the public function: help(), __doc__ and inspect.signature show the
        # body's name, docstring and signature.
        self.__doc__ = fn.__doc__
        self.__name__ = self.__qualname__ = name
        self.__module__ = fn.__module__
        self.__signature__ = inspect.signature(fn)
        OPS[name] = self

    def __call__(self, *args, **kwargs):
        # Plain eager call with nothing for the dispatcher to do: run the body directly (L104).
        if _direct_ok(args, kwargs):
            try:
                return self._init_fn(*args, **kwargs)
            except (TypeError, AttributeError):
                pass  # a malformed argument: let the dispatcher's schema check report it
        return self._packet(*args, **kwargs)

    def __get__(self, obj, objtype=None):
        # Makes the object a routine for inspect/pydoc (help() renders it as a function); a
        # class attribute stays the unbound op.
        return self

    def __repr__(self) -> str:
        return f"<moegrad op {self._qualname}{self.__signature__}>"

    def register_fake(self, fn):
        torch.library.register_fake(self._qualname, fn, lib=_LIB)
        self._abstract_fn = fn
        return fn

    def register_autograd(self, backward, *, setup_context=None):
        """The op's gradient formula (torch.library.register_autograd's arguments)."""
        if self._grad_kind == "refused":
            raise RuntimeError(f"{self._qualname}: declared no_double_backward; drop that to "
                               "register a formula")
        self._backward_fn, self._setup_context_fn = backward, setup_context
        self._grad_kind = "formula"

    # The Autograd kernel's two callbacks (registered once, in __init__).
    def _autograd_setup(self, ctx, inputs, output, keyword_only_inputs=None):
        # torch passes keyword_only_inputs to ops with keyword-only arguments only; their
        # formulas take setup_context(ctx, inputs, keyword_only_inputs, output).
        if self._setup_context_fn is None:
            return
        if keyword_only_inputs is None:
            self._setup_context_fn(ctx, inputs, output)
        else:
            self._setup_context_fn(ctx, inputs, keyword_only_inputs, output)

    def _autograd_backward(self, ctx, *grads):
        if self._backward_fn is not None:
            return self._backward_fn(ctx, *grads)
        if self._grad_kind == "refused":
            raise MoeError(f"{self._name}: double backward is not supported; "
                           f"{self._no_grad_reason}", ERR_NO_KERNEL)
        raise MoeError(f"{self._name}: backward is not supported; no gradient formula is "
                       "registered for this operator", ERR_NO_KERNEL)


_PLAIN = (int, float, bool, str, type(None), list, tuple)
_Tensor = torch.Tensor
_STRIDED = torch.strided


def _direct_ok(args, kwargs) -> bool:
    """True when a call through the dispatcher would only run the op's body (L104): no
    torch.compile / jit tracing, no dispatch or torch-function mode, no functorch transform, no
    profiler (which records the op by name), every tensor a plain, strided, non-meta
    torch.Tensor that needs no gradient (or grad mode off), every other argument a plain
    Python value. The dispatcher's
    own work for such a call (boxing the arguments twice, the autograd kernel's redispatch) is
    about 5-8 us, as much as the whole op at T=16."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._is_torch_function_mode_enabled()
            or torch._C._functorch.peek_interpreter_stack() is not None
            or torch.autograd._profiler_enabled() or torch.jit.is_tracing()):
        return False
    grad = torch.is_grad_enabled()
    for a in (*args, *kwargs.values()):
        if type(a) is _Tensor:
            # meta tensors go to the fake kernel (its device error); nested and sparse ones to
            # the dispatcher's missing-kernel error
            if (grad and a.requires_grad) or a.is_meta or a.layout is not _STRIDED:
                return False
        elif not isinstance(a, _PLAIN):
            return False
    return True


def _op(qualname: str, *, no_double_backward: Optional[str] = None):
    """Decorator: registers the function as the operator `qualname` ("moegrad::<name>").

    A backward operator without a gradient formula of its own passes no_double_backward, the
    reason shown to the user: a second-order gradient reaching it then raises MoeError
    ERR_NO_KERNEL "<name>: double backward is not supported; <reason>" (L150). Every other
    operator calls register_autograd; tests/python/test_double_backward.py checks that each
    registered operator did one or the other."""
    ns, name = qualname.split("::")
    assert ns == "moegrad", qualname
    return lambda fn: _Op(name, fn, no_double_backward)


def _needs(ctx, n: int) -> Tuple[bool, ...]:
    """needs_input_grad padded to the schema's n inputs (torch drops trailing defaults)."""
    got = tuple(ctx.needs_input_grad)
    return got + (False,) * (n - len(got))


def _args(inputs, defaults):
    """The op's inputs with the trailing defaults torch dropped filled back in."""
    return tuple(inputs) + tuple(defaults[len(inputs):])


# ---- CUDA backend: stream and workspace of the one-shot _C.<op>(..., outputs) calls ----
def _cuda_launch_context(device: int, workspace_bytes: int):
    """Called by the native module for one-shot calls on CUDA tensors: torch's current stream
    of `device` and a workspace from torch's caching allocator (None when none is needed)."""
    stream = torch.cuda.current_stream(device).cuda_stream
    ws = (torch.empty(workspace_bytes, dtype=torch.uint8, device=torch.device("cuda", device))
          if workspace_bytes else None)
    return stream, ws


_C._set_cuda_hook(_cuda_launch_context)
# ---- end CUDA launch context ----
