"""Expert parallelism of moegrad.nn.MoE on torch.distributed (gloo, 2 processes spawned here).

Outputs and every gradient of the 2-rank layer must equal the single-process layer holding all
experts, on the same global batch split between the ranks: random routing with an uneven split,
a batch routed entirely to rank 0's experts, a rank with zero tokens, shared experts.
"""
from __future__ import annotations

import os
import subprocess
import sys

import torch

import moegrad  # noqa: F401
from moegrad.nn import MoE

HERE = os.path.dirname(os.path.abspath(__file__))


def _cases(seed):
    g = torch.Generator().manual_seed(seed)
    H, F_, E, K = 16, 8, 8, 2
    out = []
    specs = [
        ("uneven split", dict(score="sigmoid", n_group=2, topk_group=2, bias_update_speed=0.01),
         [0, 13, 20], None),
        ("all to rank 0", dict(score="sigmoid", shared_experts=1, bias_update_speed=0.01),
         [0, 9, 19], "rank0"),
        ("rank 1 has no tokens", dict(score="softmax"), [0, 11, 11], None),
        ("global aux loss", dict(score="softmax", aux_loss_coef=0.1), [0, 7, 19], None),
        ("aux loss, rank 0 has no tokens", dict(score="sigmoid", aux_loss_coef=0.3),
         [0, 0, 10], None),
    ]
    for name, kw, splits, special in specs:
        m = MoE(H, F_, E, K, **kw)
        m.reset_parameters(g)
        if special == "rank0":
            m.selection_bias[E // 2:] = -10.0      # experts of rank 1 are never selected
        T = splits[-1]
        x = torch.randn(T, H, generator=g)
        up = torch.randn(T, H, generator=g)
        out.append(dict(name=name, args=(H, F_, E, K), kwargs=kw, state=m.state_dict(),
                        splits=splits, x=x, up=up))
    return out


def test_two_rank_gloo_matches_single_process(tmp_path, seed):
    cases = _cases(seed)
    torch.save(cases, tmp_path / "case.pt")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "_ep_worker.py"), str(r), "2",
                               str(tmp_path)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for r in range(2)]
    logs = [p.communicate(timeout=240)[0].decode(errors="replace") for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for i, c in enumerate(cases):
        m = MoE(*c["args"], **c["kwargs"])
        m.load_state_dict(c["state"])
        x = c["x"].clone().requires_grad_(True)
        y = m(x)
        loss = (y * c["up"]).sum()
        if m.aux_loss is not None:
            loss = loss + m.aux_loss
        loss.backward()
        m.update_bias()
        r0, r1 = ranks[0][i], ranks[1][i]
        what = c["name"]
        assert torch.allclose(torch.cat([r0["y"], r1["y"]]), y.detach(), atol=1e-6), what
        assert torch.allclose(torch.cat([r0["x_grad"], r1["x_grad"]]), x.grad, atol=1e-6), what
        for n, p in m.named_parameters():
            if n in ("w_up", "w_down"):
                got = torch.cat([r0["grads"][n], r1["grads"][n]])
            else:
                got = r0["grads"][n]
                assert torch.allclose(r1["grads"][n], got, atol=0), f"{what}: {n} differs by rank"
            assert torch.allclose(got, p.grad, rtol=1e-5, atol=1e-6), f"{what}: {n}"
        assert torch.equal(r0["bias"], m.selection_bias) and torch.equal(r1["bias"],
                                                                           m.selection_bias)
        if m.aux_loss is not None:
            # Over the tokens of both ranks: the single-process value on each rank (L88).
            for r in (r0, r1):
                assert torch.allclose(r["aux"], m.aux_loss.detach(), rtol=1e-6, atol=0), what
        else:
            assert r0["aux"] is None and r1["aux"] is None, what
        if what == "all to rank 0":
            El = m.num_local_experts
            assert torch.count_nonzero(r1["grads"]["w_up"]) == 0
            assert torch.count_nonzero(m.w_up.grad[El:]) == 0
