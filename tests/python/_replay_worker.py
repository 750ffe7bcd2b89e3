"""One rank of the expert-parallel replay test (test_routing_layer.py):
python _replay_worker.py RANK WORLD DIR.

Reads DIR/case.pt (layer config and state, global input, upstream gradient, token split, the
recorded ids of the whole batch), replays this rank's share of the ids in moegrad.nn.MoE with
ep_group = the gloo world, all-reduces the non-expert gradients and writes DIR/rank{RANK}.pt.
Then the global-batch Switch loss: a data-parallel layer (all experts on each rank) with
aux_loss_group = the world; its loss and router gradient on this rank's tokens.
"""
import sys

import torch
import torch.distributed as dist

import moegrad  # noqa: F401
from moegrad.nn import MoE, RoutingReplay, all_reduce_non_expert_grads

from _ep_worker import finish, rank_layer  # the script's folder is on sys.path


def main():
    rank, world, d = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=rank,
                            world_size=world)
    c = torch.load(f"{d}/case.pt")
    m, lo, hi = rank_layer(c, rank)
    x = c["x"][lo:hi].clone().requires_grad_(True)
    rr = RoutingReplay(m)
    with rr.replay([c["ids"][lo:hi]]):
        y = m(x)
        (y * c["up"][lo:hi]).sum().backward()
    all_reduce_non_expert_grads(m)
    out = dict(y=y.detach(), idx=m.last_expert_idx.clone(), gate_grad=m.gate.grad)
    g = MoE(*c["args"], aux_loss_coef=0.2, aux_loss_group=dist.group.WORLD)
    g.load_state_dict(c["state"])
    g(c["x"][lo:hi])
    g.aux_loss.backward()
    out.update(aux=g.aux_loss.detach(), aux_idx=g.last_expert_idx.clone(),
               aux_gate_grad=g.gate.grad)
    torch.save(out, f"{d}/rank{rank}.pt")
    finish()


if __name__ == "__main__":
    main()
