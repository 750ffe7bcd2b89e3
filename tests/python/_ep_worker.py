"""One rank of the expert-parallel test (test_ep.py): python _ep_worker.py RANK WORLD DIR.

Reads DIR/case.pt (layer config, full state dict, global input, upstream gradient, token split),
runs moegrad.nn.MoE with ep_group = the gloo world on its share of the tokens, all-reduces the
non-expert gradients and writes DIR/rank{RANK}.pt (outputs and gradients).
"""
import os
import sys

import torch
import torch.distributed as dist

import moegrad  # noqa: F401
from moegrad.nn import MoE, all_reduce_non_expert_grads


def rank_layer(c, rank, **kwargs):
    """(layer, lo, hi): the expert-parallel layer of `rank` (its share of the experts from the
    full state c["state"]) and the bounds of its tokens in c["splits"]."""
    m = MoE(*c["args"], ep_group=dist.group.WORLD, **kwargs)
    El = m.num_local_experts
    sd = dict(c["state"])
    for n in ("w_up", "w_down"):
        sd[n] = sd[n][rank * El:(rank + 1) * El]
    m.load_state_dict(sd)
    return m, c["splits"][rank], c["splits"][rank + 1]


def finish():
    """Ends the rank once its results are on disk: a barrier (every rank is done with the
    group), then an immediate exit. A gloo process group torn down by destroy_process_group and
    the interpreter's exit while the peer is doing the same aborted a rank in one CI run
    ("terminate called without an active exception", exit -6) under load; the exit skips that
    teardown, there being nothing left to release but the process itself."""
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main():
    rank, world, d = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=rank,
                            world_size=world)
    case = torch.load(f"{d}/case.pt")
    results = []
    for c in case:
        m, lo, hi = rank_layer(c, rank, **c["kwargs"])
        x = c["x"][lo:hi].clone().requires_grad_(True)
        y = m(x)
        loss = (y * c["up"][lo:hi]).sum()
        if m.aux_loss is not None:
            loss = loss + m.aux_loss       # the global value, the same on every rank (L88)
        loss.backward()
        all_reduce_non_expert_grads(m)
        m.update_bias()
        results.append(dict(y=y.detach(), x_grad=x.grad,
                            grads={n: p.grad for n, p in m.named_parameters()},
                            bias=m.selection_bias.clone(),
                            aux=None if m.aux_loss is None else m.aux_loss.detach()))
    torch.save(results, f"{d}/rank{rank}.pt")
    finish()


if __name__ == "__main__":
    main()
