"""moegrad.nn.MoE checks its arguments when it is built, in its own names, and names itself when
an input does not fit (docs/layer.md "Arguments and errors", docs/decisions.md L172).

Each wrong argument raises at construction (not at the first forward under an operator's
argument names): ValueError for a wrong value, TypeError for a wrong type, with the message
"MoE: <argument>: <rule>; got <value>".
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.distributed as dist

from moegrad.nn import MoE

H, F, E, K = 8, 4, 8, 2

# (keyword arguments over the defaults above, exception, argument named, value shown)
WRONG = [
    (dict(top_k=9), ValueError, "top_k", "9", "must be <= num_experts (8)"),
    (dict(top_k=0), ValueError, "top_k", "0", "must be >= 1"),
    (dict(n_group=3), ValueError, "n_group", "3", "must divide num_experts (8)"),
    (dict(n_group=2, topk_group=3), ValueError, "topk_group", "3", "must be <= n_group (2)"),
    (dict(n_group=4, topk_group=1, top_k=3), ValueError, "top_k", "3",
     "must be <= topk_group * num_experts / n_group"),
    (dict(n_group=8, topk_group=8), ValueError, "n_group", "8", "must leave >= 2 experts"),
    (dict(score="relu"), ValueError, "score", "'relu'", "must be 'sigmoid' or 'softmax'"),
    (dict(clamp_limit=0.0), ValueError, "clamp_limit", "0.0", "must be -1 (off) or > 0"),
    (dict(clamp_limit=-2.0), ValueError, "clamp_limit", "-2.0", "must be -1 (off) or > 0"),
    (dict(clamp_limit=float("nan")), ValueError, "clamp_limit", "nan", "must be finite"),
    (dict(clamp_limit="7"), TypeError, "clamp_limit", "'7'", "must be a number"),
    (dict(capacity_factor=0.0), ValueError, "capacity_factor", "0.0",
     "must be None (dropless) or finite and > 0"),
    (dict(capacity_factor=-1), ValueError, "capacity_factor", "-1", "finite and > 0"),
    (dict(capacity_factor=float("inf")), ValueError, "capacity_factor", "inf",
     "finite and > 0"),
    (dict(capacity_factor="1.25"), TypeError, "capacity_factor", "'1.25'", "a number"),
    (dict(dtype=torch.int32), TypeError, "dtype", "torch.int32",
     "must be None, torch.float32, torch.float16 or torch.bfloat16"),
    (dict(dtype=torch.float64), TypeError, "dtype", "torch.float64", "must be None"),
    (dict(routed_scaling_factor=float("inf")), ValueError, "routed_scaling_factor", "inf",
     "must be finite"),
    (dict(hidden=8.0), TypeError, "hidden", "8.0", "must be an int"),
    (dict(num_experts=True), TypeError, "num_experts", "True", "must be an int"),
    (dict(shared_experts=-1), ValueError, "shared_experts", "-1", "must be >= 0"),
    (dict(bias_update_speed=-0.1), ValueError, "bias_update_speed", "-0.1", "must be >= 0"),
    (dict(aux_loss_coef=-1.0), ValueError, "aux_loss_coef", "-1.0", "must be >= 0"),
]


def _build(**kw):
    args = dict(hidden=H, ffn_hidden=F, num_experts=E, top_k=K)
    args.update(kw)
    pos = [args.pop(n) for n in ("hidden", "ffn_hidden", "num_experts", "top_k")]
    return MoE(*pos, **args)


@pytest.mark.parametrize("kw,exc,name,shown,rule", WRONG,
                         ids=[f"{w[2]}={w[3]}" for w in WRONG])
def test_construction_refuses_in_the_layers_names(kw, exc, name, shown, rule):
    with pytest.raises(exc) as info:
        _build(**kw)
    msg = str(info.value)
    assert type(info.value) is exc
    assert msg.startswith(f"MoE: {name}: "), msg
    assert rule in msg, msg
    assert msg.endswith(f"; got {shown}"), msg


def test_good_arguments_still_build():
    _build()
    _build(score="softmax", n_group=8, topk_group=8)      # softmax: one expert per group is fine
    _build(n_group=4, topk_group=2, top_k=4, clamp_limit=7.0, capacity_factor=1,
           shared_experts=1, dtype=torch.bfloat16)
    _build(hidden=np.int64(8), routed_scaling_factor=np.float32(2.5))   # numpy scalars
    _build(top_k=E)                                        # K = E


def test_ep_group_size_must_divide_num_experts(monkeypatch):
    group = object()                                       # a 3-rank group, as seen by rank 0
    monkeypatch.setattr(dist, "get_world_size", lambda g=None: 3 if g is group else 1)
    monkeypatch.setattr(dist, "get_rank", lambda g=None: 0)
    with pytest.raises(ValueError, match=r"^MoE: ep_group: its size must divide num_experts "
                                         r"\(8\).*; got size 3$"):
        _build(ep_group=group)
    with pytest.raises(NotImplementedError, match="capacity_factor with ep_group"):
        _build(num_experts=6, ep_group=group, capacity_factor=1.0)
    assert _build(num_experts=6, ep_group=group).w_up.shape[0] == 2


@pytest.mark.parametrize("layer_dtype,x_dtype", [(torch.float32, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32),
                                                 (torch.float32, torch.float64)])
def test_input_of_another_dtype_names_the_layer(layer_dtype, x_dtype):
    layer = _build(dtype=layer_dtype)
    x = torch.randn(5, H, dtype=x_dtype)
    with pytest.raises(TypeError, match=rf"^MoE: x: dtype must be the layer's, "
                                        rf"{re.escape(str(layer_dtype))} .*; got "
                                        rf"{re.escape(str(x_dtype))}$"):
        layer(x)
    y = layer(x.to(layer_dtype))                              # the fix the message names
    assert y.dtype == layer_dtype and y.shape == x.shape


def test_input_of_another_width_names_the_layer():
    with pytest.raises(ValueError, match=r"^MoE: x: must be \[T, 8\] or \[B, S, 8\] "
                                         r"\(hidden = 8\); got shape \[3, 7\]$"):
        _build()(torch.randn(3, 7))
