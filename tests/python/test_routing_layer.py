"""Routing in moegrad.nn.MoE (docs/layer.md "Routing options", "Routing replay"; D33-D35):
RoutingReplay (an RL step, checkpoint recomputation, torch.compile, errors, saved ids), the
balance losses against plain-torch autograd of their formulas, load statistics, padding masks,
fp32 router precision and top-1 routing."""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import moegrad
from moegrad.nn import MoE, RoutingReplay

HERE = os.path.dirname(os.path.abspath(__file__))
H, FF, E, K = 16, 8, 8, 2


class Block(torch.nn.Module):
    """Two MoE layers with a dense layer between; optionally checkpointed per layer."""

    def __init__(self, ckpt=False, **kw):
        super().__init__()
        self.a, self.b = MoE(H, FF, E, K, **kw), MoE(H, FF, E, K, **kw)
        self.mid = torch.nn.Linear(H, H)
        self.ckpt = ckpt

    def forward(self, x):
        run = (lambda f, t: checkpoint(f, t, use_reentrant=False)) if self.ckpt else \
            (lambda f, t: f(t))
        h = x + run(self.a, x)
        h = torch.tanh(self.mid(h))
        return h + run(self.b, h)


def _perturbed(model, gen, scale=0.5):
    b = copy.deepcopy(model)
    with torch.no_grad():
        for m in (b.a, b.b):
            m.gate.add_(scale * torch.randn(m.gate.shape, generator=gen))
    return b


# ------------------------------------------------------------------------------ RoutingReplay --
@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_rl_step_replays_rollout_choices_with_router_gradients(score, seed):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    a = Block(score=score)
    x = torch.randn(24, H, generator=gen)
    rec = RoutingReplay(a)
    with torch.no_grad(), rec.record():
        a.eval()
        a(x)
    ids = rec.ids
    assert len(ids) == 2 and all(t.shape == (24, K) for t in ids)
    chosen = [a.a.last_expert_idx.clone(), a.b.last_expert_idx.clone()]
    b = _perturbed(a, gen)
    b.train()
    rep = RoutingReplay(b)
    up = torch.randn(24, H, generator=gen)
    with rep.replay(ids):
        loss = (b(x) * up).sum()
        loss.backward()
    assert torch.equal(b.a.last_expert_idx, chosen[0])
    assert torch.equal(b.b.last_expert_idx, chosen[1])
    # Selection by B itself would differ (the perturbation moves the choice).
    with torch.no_grad():
        b(x)
    assert not (torch.equal(b.a.last_expert_idx, chosen[0])
                and torch.equal(b.b.last_expert_idx, chosen[1]))
    g = b.a.gate.grad
    assert g is not None and g.abs().sum() > 0 and b.b.gate.grad.abs().sum() > 0

    # Finite differences of the replayed loss w.r.t. gate entries (the loss is smooth in the gate
    # once the experts are fixed).
    def replayed_loss():
        with torch.no_grad(), rep.replay(ids):
            return float((b(x) * up).double().sum())
    h = 1e-2
    for (i, j) in [(0, 0), (3, 5), (7, 15), (int(chosen[0][0, 0]), 2)]:
        with torch.no_grad():
            b.a.gate[i, j] += h
        lp = replayed_loss()
        with torch.no_grad():
            b.a.gate[i, j] -= 2 * h
        lm = replayed_loss()
        with torch.no_grad():
            b.a.gate[i, j] += h
        fd = (lp - lm) / (2 * h)
        assert abs(fd - float(g[i, j])) <= 2e-2 * max(1.0, abs(fd)), (i, j, fd, float(g[i, j]))


def test_replay_errors_never_reselect(seed):
    torch.manual_seed(seed)
    a = Block()
    x = torch.randn(10, H)
    rr = RoutingReplay(a)
    with rr.record():
        a(x)
    ids = list(rr.ids)
    with pytest.raises(RuntimeError, match="#1 has no recorded ids"):
        with rr.replay(ids[:1]):
            a(x)
    with pytest.raises(ValueError, match=r"ids\[0\]: must have the shape \[T, K\] = \[10, 2\]"):
        with rr.replay([torch.zeros(9, 2, dtype=torch.int32), ids[1]]):
            a(x)
    with pytest.raises(ValueError, match="values must lie in"):
        with rr.replay([torch.full((10, 2), E, dtype=torch.int32), ids[1]]):
            a(x)
    with pytest.raises(ValueError, match="integer tensor"):
        rr.load([torch.zeros(10, 2)])


def test_saved_ids_replay_the_same_forward(tmp_path, seed):
    torch.manual_seed(seed)
    a = Block(score="softmax")
    x = torch.randn(12, H)
    rr = RoutingReplay(a)
    with rr.record():
        y = a(x)
    torch.save(rr.state_dict(), tmp_path / "ids.pt")
    b = copy.deepcopy(a)
    rb = RoutingReplay(b)
    rb.load_state_dict(torch.load(tmp_path / "ids.pt"))
    with rb.replay():
        y2 = b(x)
    assert torch.equal(y, y2)
    # A rollout engine's int64 choice works too: any distinct ids per row.
    ids = [torch.stack([torch.randperm(E)[:K] for _ in range(12)]) for _ in range(2)]
    with rb.replay(ids):
        b(x)
    assert torch.equal(b.a.last_expert_idx.long(), ids[0])


def test_checkpoint_recomputation_replays_and_counts_once(seed):
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    plain = Block()
    ck = copy.deepcopy(plain)
    ck.ckpt = True
    x = torch.randn(20, H, generator=gen)
    up = torch.randn(20, H, generator=gen)
    # Ids that selection would not choose: a recomputation that re-selected would change the
    # gradients.
    ids = [torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(20)])
           for _ in range(2)]
    grads = []
    for model in (plain, ck):
        rr = RoutingReplay(model)
        with rr.replay(ids):
            (model(x) * up).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        assert torch.equal(model.a.tokens_per_expert,
                           torch.bincount(ids[0].reshape(-1), minlength=E).float())
        rr.detach()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-6, atol=1e-7)
    # Recording under checkpointing records each forward once.
    rr = RoutingReplay(ck)
    with rr.record():
        (ck(x) * up).sum().backward()
    assert len(rr.ids) == 2
    # Without a replay the statistics are also counted once per step.
    rr.detach()
    for m in (ck.a, ck.b, plain.a, plain.b):
        m.tokens_per_expert.zero_()
    for model in (plain, ck):
        (model(x) * up).sum().backward()
    assert torch.equal(ck.a.tokens_per_expert, plain.a.tokens_per_expert)
    assert ck.a.tokens_per_expert.sum() == 20 * K


@pytest.mark.parametrize("where", ["checkpoint inside the compiled model",
                                   "eager checkpoint of a compiled layer"])
def test_load_counted_once_with_compile_and_checkpoint(where, seed):
    """tokens_per_expert counts each token once per step with torch.compile and activation
    checkpointing in either nesting (L187)."""
    torch._dynamo.reset()
    torch.manual_seed(seed)
    x = torch.randn(20, H)
    if where.startswith("checkpoint inside"):
        model = Block(ckpt=True)
        out = torch.compile(model, backend="aot_eager")(x)
    else:
        model = Block()
        out = checkpoint(torch.compile(model.a, backend="aot_eager"), x, use_reentrant=False)
    (out * torch.randn_like(out)).sum().backward()
    assert model.a.tokens_per_expert.sum().item() == 20 * K
    assert torch.equal(model.a.tokens_per_expert, model.a.last_load.float())


def test_replay_under_torch_compile(seed):
    torch.manual_seed(seed)
    a = Block(score="softmax")
    x = torch.randn(16, H)
    rr = RoutingReplay(a)
    with rr.record():
        y = a(x)
    b = _perturbed(a, torch.Generator().manual_seed(seed))
    rb = RoutingReplay(b)
    compiled = torch.compile(b, backend="eager")
    with rb.replay(rr.ids):
        yc = compiled(x)
        yc.sum().backward()
    gc = b.a.gate.grad.clone()
    b.zero_grad()
    with rb.replay(rr.ids):
        ye = b(x)
        ye.sum().backward()
    assert torch.equal(b.a.last_expert_idx, rr.ids[0])
    torch.testing.assert_close(yc, ye)
    torch.testing.assert_close(gc, b.a.gate.grad)
    assert not torch.equal(y, ye)  # the weights do change (perturbed router)


def test_replay_with_expert_parallelism_on_two_gloo_ranks(tmp_path, seed):
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    a = MoE(H, FF, E, K, score="sigmoid")
    a.reset_parameters(gen)
    x = torch.randn(18, H, generator=gen)
    up = torch.randn(18, H, generator=gen)
    rr = RoutingReplay(a)
    with torch.no_grad(), rr.record():
        a(x)
    b = copy.deepcopy(a)
    with torch.no_grad():
        b.gate.add_(0.5 * torch.randn(b.gate.shape, generator=gen))
    torch.save(dict(state=b.state_dict(), x=x, up=up, ids=rr.ids[0], splits=[0, 7, 18],
                    args=(H, FF, E, K)), tmp_path / "case.pt")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "_replay_worker.py"), str(r),
                               "2", str(tmp_path)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for r in range(2)]
    logs = [p.communicate(timeout=240)[0].decode(errors="replace") for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    rb = RoutingReplay(b)
    xg = x.clone().requires_grad_(True)
    with rb.replay(rr.ids):
        y = b(xg)
        (y * up).sum().backward()
    assert torch.equal(torch.cat([r0["idx"], r1["idx"]]), rr.ids[0])
    torch.testing.assert_close(torch.cat([r0["y"], r1["y"]]), y.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(r0["gate_grad"], b.gate.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(r1["gate_grad"], b.gate.grad, atol=1e-6, rtol=1e-5)
    # Global-batch Switch loss (D35): f from the selections of both ranks, P of each rank's own
    # tokens; against plain-torch autograd of that formula.
    counts = torch.bincount(torch.cat([r0["aux_idx"], r1["aux_idx"]]).reshape(-1).long(),
                            minlength=E).double()
    f = counts / (18 * K)
    for r, (lo, hi) in zip((r0, r1), ((0, 7), (7, 18))):
        gate = b.gate.detach().clone().double().requires_grad_(True)
        s = torch.sigmoid(F.linear(x[lo:hi].double(), gate))
        loss = 0.2 * E * (f * (s / s.sum(-1, keepdim=True)).mean(0)).sum()
        loss.backward()
        torch.testing.assert_close(r["aux"].double(), loss.detach(), rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(r["aux_gate_grad"].double(), gate.grad, rtol=1e-4, atol=1e-7)


# ---------------------------------------------------------------------- norm_topk_prob, K = 1 --
@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_norm_topk_prob_false_uses_scores_as_weights(score, seed):
    torch.manual_seed(seed)
    m = MoE(H, FF, E, K, score=score, norm_topk_prob=False, routed_scaling_factor=2.0)
    x = torch.randn(9, H)
    w, idx, _ = m.route(x)
    logits = F.linear(x, m.gate).double()
    s = torch.sigmoid(logits) if score == "sigmoid" else torch.softmax(logits, -1)
    torch.testing.assert_close(w.double(), 2.0 * s.gather(1, idx.long()), rtol=1e-5, atol=1e-6)


def test_top1_needs_norm_topk_prob_false_and_then_trains_the_router(seed):
    with pytest.raises(ValueError, match="norm_topk_prob"):
        MoE(H, FF, E, 1)
    torch.manual_seed(seed)
    m = MoE(H, FF, E, 1, norm_topk_prob=False)
    m(torch.randn(10, H)).square().sum().backward()
    assert m.gate.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- balance losses --
def _formula_inputs(m, x):
    logits = F.linear(x, m.gate)
    s = torch.sigmoid(logits) if m.score == "sigmoid" else torch.softmax(logits, -1)
    return logits, s


@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_z_loss_matches_torch_formula(score, seed):
    torch.manual_seed(seed)
    m = MoE(H, FF, E, K, score=score, z_loss_coef=0.01)
    x = torch.randn(3, 7, H)
    m(x)
    m.z_loss.backward()
    g = m.gate.grad.clone()
    gate = m.gate.detach().clone().double().requires_grad_(True)
    z = 0.01 * torch.logsumexp(F.linear(x.reshape(-1, H).double(), gate), -1).square().mean()
    z.backward()
    torch.testing.assert_close(m.z_loss.double(), z.detach(), rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(g.double(), gate.grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_seq_aux_loss_matches_torch_formula(score, seed):
    torch.manual_seed(seed)
    m = MoE(H, FF, E, K, score=score, seq_aux_loss_coef=0.1)
    B, S = 3, 7
    x = torch.randn(B, S, H)
    m(x)
    m.seq_aux_loss.backward()
    g = m.gate.grad.clone()
    idx = m.last_expert_idx.long().reshape(B, S, K)
    gate = m.gate.detach().clone().double().requires_grad_(True)
    losses = []
    for b in range(B):
        logits = F.linear(x[b].double(), gate)
        s = torch.sigmoid(logits) if score == "sigmoid" else torch.softmax(logits, -1)
        p = (s / s.sum(-1, keepdim=True)).mean(0)
        f = torch.zeros(E, dtype=torch.float64)
        for t in range(S):
            for k in range(K):
                f[idx[b, t, k]] += E / (K * S)
        losses.append((f * p).sum())
    ref = 0.1 * torch.stack(losses).mean()
    ref.backward()
    torch.testing.assert_close(m.seq_aux_loss.double(), ref.detach(), rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(g.double(), gate.grad, rtol=1e-4, atol=1e-7)


def test_zero_coefficients_cost_nothing(monkeypatch, seed):
    torch.manual_seed(seed)
    m = MoE(H, FF, E, K)
    flags = []
    real = moegrad.moe_gating_top_k

    def spy(*a, **kw):
        flags.append(kw.get("out_flag"))
        return real(*a, **kw)
    monkeypatch.setattr(moegrad, "moe_gating_top_k", spy)
    m(torch.randn(2, 5, H))
    assert flags == [False]                  # no scores are even written
    assert m.z_loss is None and m.seq_aux_loss is None and m.aux_loss is None


# ------------------------------------------------------------------------- load statistics --
def test_load_statistics(seed):
    torch.manual_seed(seed)
    m = MoE(H, FF, E, K)
    x = torch.randn(13, H)
    m(x)
    want = torch.bincount(m.last_expert_idx.reshape(-1).long(), minlength=E)
    assert torch.equal(m.last_load.long(), want)
    assert torch.equal(m.tokens_per_expert, want.float())
    m.eval()
    with torch.no_grad():
        m(x)
    assert torch.equal(m.tokens_per_expert, want.float()), "eval forwards count nothing"


# --------------------------------------------------------------------------- padding masks --
@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_padding_mask_equals_batch_without_padding(score, seed):
    torch.manual_seed(seed)
    m = MoE(H, FF, E, K, score=score, shared_experts=1, aux_loss_coef=0.1,
            seq_aux_loss_coef=0.05, z_loss_coef=0.01)
    B, S = 3, 6
    lengths = [6, 2, 4]
    x = torch.randn(B, S, H)
    mask = torch.zeros(B, S, dtype=torch.int64)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    xm = x.clone().requires_grad_(True)
    y = m(xm, mask=mask)
    losses = (m.aux_loss, m.seq_aux_loss, m.z_loss)
    load = m.last_load.clone()
    assert torch.all(y[mask == 0] == 0)
    (y.square().sum() + sum(losses)).backward()
    gm = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    # The same tokens without padding: one [T, H] batch for the output, the Switch loss and the
    # z-loss; the sequence-wise loss from each sequence on its own.
    xr = x[mask.bool()].clone().requires_grad_(True)
    yr = m(xr)
    torch.testing.assert_close(y[mask.bool()], yr, rtol=1e-5, atol=1e-6)
    assert torch.equal(load, m.last_load)
    torch.testing.assert_close(losses[0], m.aux_loss)
    torch.testing.assert_close(losses[2], m.z_loss)
    seq_losses = []
    for b, n in enumerate(lengths):
        m(x[b:b + 1, :n])
        seq_losses.append(m.seq_aux_loss)
    torch.testing.assert_close(losses[1], torch.stack(seq_losses).mean())
    torch.testing.assert_close(xm.grad[mask == 0], torch.zeros_like(xm.grad[mask == 0]))


# ------------------------------------------------------------------------ router precision --
def test_bf16_layer_ranks_in_fp32():
    m = MoE(H, FF, 4, 1, score="softmax", norm_topk_prob=False, dtype=torch.bfloat16)
    with torch.no_grad():
        m.gate.zero_()
        m.gate[0, 0] = 1.0
        m.gate[1, 0] = 1.0
        m.gate[1, 1] = 2.0 ** -12           # expert 1 is larger by 2^-12 (below bf16 resolution)
    x = torch.zeros(4, H, dtype=torch.bfloat16)
    x[:, 0] = 1.0
    x[:, 1] = 1.0
    # In bf16, logit 1 + 2^-12 rounds to 1: a tie that would go to expert 0.
    assert F.linear(x, m.gate)[0, 1] == F.linear(x, m.gate)[0, 0]
    m(x)
    assert torch.all(m.last_expert_idx == 1)
