"""Train a tiny MoE language model with moegrad ops, side by side with plain PyTorch.

Run ``python -m moegrad.demo --help``. See docs/demo.md for the model, the flags and the
tolerance used to decide whether the two models agree.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

FORTUNES_DIR = "/usr/share/games/fortunes"

# Agreement thresholds (fp32). How they were measured and why they hold: docs/demo.md.
LOSS_TOL = 1e-3          # max over all steps of |loss_moegrad - loss_reference|
GRAD_TOL = 1e-5          # ||g_moegrad - g_ref|| / ||g_ref|| over the MoE parameters at step 0


# --------------------------------------------------------------------------------------------
# TEMPORARY development stand-in for moegrad (plain torch). Must be removed before finishing.
try:
    import moegrad as _mg
    _DEV_STANDIN = False
except ImportError:  # pragma: no cover
    _DEV_STANDIN = True

    class _mg:  # noqa: N801
        @staticmethod
        def moe_gating_top_k(x, k, bias=None, k_group=1, group_count=1, group_select_mode=0,
                             renorm=0, norm_type=0, out_flag=False, routed_scaling_factor=1.0,
                             eps=1e-20):
            s = torch.sigmoid(x.float())
            sel = (s + bias.float()) if bias is not None else s
            M, N = s.shape
            gs = sel.view(M, group_count, N // group_count)
            gscore = gs.topk(2, dim=-1).values.sum(-1) if group_select_mode == 1 else gs.amax(-1)
            gidx = torch.sort(gscore, dim=-1, descending=True, stable=True).indices[:, :k_group]
            gmask = torch.zeros(M, group_count, dtype=torch.bool).scatter_(1, gidx, True)
            sel = sel.masked_fill(~gmask.repeat_interleave(N // group_count, 1), float("-inf"))
            idx = torch.sort(sel.detach(), dim=-1, descending=True, stable=True).indices[:, :k]
            g = s.gather(1, idx)
            y = g / (g.sum(-1, keepdim=True) + eps) * routed_scaling_factor
            return y.to(x.dtype), idx.to(torch.int32), torch.zeros(M, N)

        @staticmethod
        def swiglu_group(x, weight=None, group_index=None, clamp_limit=-1.0):
            h = x.shape[-1] // 2
            return F.silu(x[..., :h]) * x[..., h:]

        @staticmethod
        def moe_finalize_routing(expanded_x, expanded_row_idx, x1=None, x2=None, bias=None,
                                 scales=None, expert_idx=None, drop_pad_mode=0, k=1):
            R, K = scales.shape
            g = expanded_x[expanded_row_idx.long()].view(K, R, -1)
            return (g * scales.t().unsqueeze(-1)).sum(0)
# --------------------------------------------------------------------------------------------


# ------------------------------------------------------------------------------------ data --

def load_text(path: str | None) -> bytes:
    """Bytes of the training text: ``path`` if given, else the plain fortunes files."""
    if path is not None:
        with open(path, "rb") as f:
            data = f.read()
        if len(data) < 2:
            raise SystemExit(f"moegrad.demo: --data {path!r} holds {len(data)} bytes; need text")
        return data
    hint = ("moegrad.demo: no training text found. The default data is Debian's fortunes "
            f"package ({FORTUNES_DIR}/*). Install it with `apt-get install fortunes` "
            "(as root), or pass any text file with --data PATH.")
    if not os.path.isdir(FORTUNES_DIR):
        raise SystemExit(hint)
    parts = []
    for name in sorted(os.listdir(FORTUNES_DIR)):
        full = os.path.join(FORTUNES_DIR, name)
        # Plain-text files only: skip the strfile indexes (.dat), the .u8 links and sub-folders
        # such as off/ (the offensive set).
        if name.endswith((".dat", ".u8")) or os.path.islink(full) or not os.path.isfile(full):
            continue
        with open(full, "rb") as f:
            parts.append(f.read())
    data = b"".join(parts)
    if len(data) < 2:
        raise SystemExit(hint)
    return data


class Batches:
    """Random windows of the byte stream; one generator so both models see the same batches."""

    def __init__(self, data: bytes, batch: int, seq: int, seed: int):
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.batch, self.seq = batch, seq
        if self.data.numel() < seq + 2:
            raise SystemExit(f"moegrad.demo: text has {self.data.numel()} bytes; need at least "
                             f"--seq + 2 = {seq + 2}")
        self.gen = torch.Generator().manual_seed(seed + 1)

    def next(self):
        hi = self.data.numel() - self.seq - 1
        starts = torch.randint(0, hi + 1, (self.batch,), generator=self.gen)
        offs = torch.arange(self.seq + 1)
        w = self.data[starts[:, None] + offs[None, :]]
        return w[:, :-1], w[:, 1:]


# ----------------------------------------------------------------------------------- model --

def route_permutation(expert_idx: torch.Tensor, n_experts: int):
    """Sort the R*K (token, slot) assignments by expert (stable).

    Returns ``order`` (sorted position -> column-flat slot index k*R + r), ``row_idx`` (its
    inverse: expanded_row_idx of moe_finalize_routing, drop_pad_mode 0, column layout, D8),
    ``counts`` (tokens per expert, int64) and ``tok`` (the token row of each sorted position).
    """
    R, K = expert_idx.shape
    flat_e = expert_idx.t().reshape(-1).long()            # column layout: [k*R + r] = idx[r, k]
    order = torch.argsort(flat_e, stable=True)
    row_idx = torch.empty_like(order)
    row_idx[order] = torch.arange(R * K, device=order.device)
    counts = torch.bincount(flat_e, minlength=n_experts)
    tok = order % R
    return order, row_idx, counts, tok


class MoEFeedForward(nn.Module):
    """DeepSeek-V3 style MoE FFN. ``impl`` is "moegrad" (fused ops) or "torch" (reference)."""

    def __init__(self, d_model, d_expert, n_experts, top_k, n_groups, topk_groups,
                 routed_scale, bias_update, impl):
        super().__init__()
        self.impl = impl
        self.E, self.K, self.Fh = n_experts, top_k, d_expert
        self.n_groups, self.topk_groups = n_groups, topk_groups
        self.routed_scale, self.bias_update = routed_scale, bias_update
        self.router = nn.Parameter(torch.randn(n_experts, d_model) * 0.02)
        self.w_up = nn.Parameter(torch.randn(n_experts, d_model, 2 * d_expert) / math.sqrt(d_model))
        self.w_down = nn.Parameter(torch.randn(n_experts, d_expert, d_model)
                                   / math.sqrt(d_expert) / 2)
        # Selection bias of aux-loss-free load balancing: used for ranking only, no gradient.
        self.register_buffer("sel_bias", torch.zeros(n_experts))
        self.last_counts = None
        self.last_idx = None

    # -- routing ------------------------------------------------------------------------------
    def _gate_torch(self, logits):
        T, E = logits.shape
        s = torch.sigmoid(logits)
        sel = (s + self.sel_bias).detach()
        gs = sel.view(T, self.n_groups, E // self.n_groups)
        gscore = gs.topk(2, dim=-1).values.sum(-1)                 # top-2 sum per group
        gidx = gscore.topk(self.topk_groups, dim=-1).indices
        gmask = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, gidx, True)
        sel = sel.masked_fill(~gmask.repeat_interleave(E // self.n_groups, 1), float("-inf"))
        idx = sel.topk(self.K, dim=-1).indices
        g = s.gather(1, idx)
        y = g / (g.sum(-1, keepdim=True) + 1e-20) * self.routed_scale
        return y, idx

    def _gate_moegrad(self, logits):
        y, idx, _ = _mg.moe_gating_top_k(
            logits, self.K, bias=self.sel_bias, k_group=self.topk_groups,
            group_count=self.n_groups, group_select_mode=1, renorm=0, norm_type=1,
            out_flag=False, routed_scaling_factor=self.routed_scale, eps=1e-20)
        return y, idx.long()

    # -- forward ------------------------------------------------------------------------------
    def forward(self, h):
        shape = h.shape
        h = h.reshape(-1, shape[-1])
        R = h.shape[0]
        logits = F.linear(h, self.router)
        y, idx = self._gate_moegrad(logits) if self.impl == "moegrad" else self._gate_torch(logits)
        order, row_idx, counts, tok = route_permutation(idx, self.E)
        self.last_counts, self.last_idx = counts, idx
        xs = h[tok]
        sizes = counts.tolist()
        up = torch.cat([xe @ self.w_up[e] for e, xe in enumerate(xs.split(sizes))])
        if self.impl == "moegrad":
            act = _mg.swiglu_group(up, group_index=counts)
        else:
            act = F.silu(up[:, :self.Fh]) * up[:, self.Fh:]
        expanded = torch.cat([ae @ self.w_down[e] for e, ae in enumerate(act.split(sizes))])
        if self.impl == "moegrad":
            out = _mg.moe_finalize_routing(expanded, row_idx, scales=y, drop_pad_mode=0, k=self.K)
        else:
            scale = y.t().reshape(-1)[order]
            out = torch.zeros_like(h).index_add_(0, tok, expanded * scale[:, None])
        return out.reshape(shape)

    @torch.no_grad()
    def update_bias(self):
        """Aux-loss-free balancing: push under-loaded experts up, over-loaded ones down."""
        load = self.last_counts.float()
        self.sel_bias += self.bias_update * torch.sign(load.mean() - load)


class Block(nn.Module):
    def __init__(self, cfg, impl):
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.norm1 = nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.norm2 = nn.RMSNorm(d)
        self.moe = MoEFeedForward(d, cfg.d_expert, cfg.experts, cfg.top_k, cfg.groups,
                                  cfg.topk_groups, cfg.routed_scale, cfg.bias_update, impl)

    def forward(self, x):
        B, S, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, S, 3, self.n_heads, D // self.n_heads) \
            .permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, S, D))
        x = x + self.moe(self.norm2(x))             # residual add outside the finalize op
        return x


class TinyMoELM(nn.Module):
    def __init__(self, cfg, impl):
        super().__init__()
        self.tok = nn.Embedding(256, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)
        self.blocks = nn.ModuleList([Block(cfg, impl) for _ in range(cfg.layers)])
        self.norm = nn.RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, 256, bias=False)

    def forward(self, idx, targets=None):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))

    def moe_layers(self):
        return [b.moe for b in self.blocks]

    def moe_params(self):
        return [p for m in self.moe_layers() for p in (m.router, m.w_up, m.w_down)]


# -------------------------------------------------------------------------------- training --

class Progress:
    """A tiny progress bar on stderr (in place on a terminal, a line per 10% otherwise)."""

    def __init__(self, total, enabled=True):
        self.total, self.enabled = total, enabled
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self.last_decile = -1

    def update(self, step, text):
        if not self.enabled:
            return
        done = step + 1
        frac = done / max(self.total, 1)
        width = 30
        fill = int(round(frac * width))
        el = time.perf_counter() - self.t0
        eta = el / done * (self.total - done)
        line = (f"[{'#' * fill}{'.' * (width - fill)}] {done}/{self.total} {text} "
                f"{el:5.1f}s eta {eta:4.0f}s")
        if self.tty:
            sys.stderr.write("\r" + line)
            if done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()
        else:
            decile = int(frac * 10)
            if decile != self.last_decile or done == self.total:
                self.last_decile = decile
                sys.stderr.write(line + "\n")
                sys.stderr.flush()


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m moegrad.demo",
        description="Train a tiny byte-level MoE language model whose MoE layers run on moegrad "
                    "ops, side by side with the same model in plain PyTorch, and check that both "
                    "agree.")
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--data", default=None,
                   help=f"text file to train on (default: the plain files in {FORTUNES_DIR})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG of both loss curves")
    g = p.add_argument_group("model size")
    g.add_argument("--batch", type=int, default=16)
    g.add_argument("--seq", type=int, default=64)
    g.add_argument("--d-model", type=int, default=64)
    g.add_argument("--n-heads", type=int, default=4)
    g.add_argument("--layers", type=int, default=2)
    g.add_argument("--experts", type=int, default=8)
    g.add_argument("--groups", type=int, default=4, help="expert groups")
    g.add_argument("--topk-groups", type=int, default=2, help="groups kept per token")
    g.add_argument("--top-k", type=int, default=2, help="experts per token")
    g.add_argument("--d-expert", type=int, default=128, help="expert hidden size F")
    g.add_argument("--routed-scale", type=float, default=1.0)
    o = p.add_argument_group("optimisation")
    o.add_argument("--lr", type=float, default=3e-3)
    o.add_argument("--warmup", type=int, default=20)
    o.add_argument("--bias-update", type=float, default=1e-3,
                   help="aux-loss-free selection-bias step u (DeepSeek-V3)")
    o.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave)")
    o.add_argument("--quiet", action="store_true", help="no progress bar")
    o.add_argument("--sample", type=int, default=160,
                   help="bytes of text to sample from the moegrad model at the end (0: none)")
    a = p.parse_args(argv)
    if a.d_model % a.n_heads:
        p.error("--d-model must be a multiple of --n-heads")
    if a.experts % a.groups:
        p.error("--experts must be a multiple of --groups")
    if a.steps < 1:
        p.error("--steps must be >= 1")
    return a


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(args.steps - args.warmup, 1)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def grad_rel_diff(pa, pb):
    num = sum(float((a.grad.double() - b.grad.double()).pow(2).sum()) for a, b in zip(pa, pb))
    den = sum(float(b.grad.double().pow(2).sum()) for b in pb)
    return math.sqrt(num) / max(math.sqrt(den), 1e-300)


def train_step(model, opt, x, t, lr, device):
    for g in opt.param_groups:
        g["lr"] = lr
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = model(x, t)
    loss.backward()
    return loss, t0


def finish_step(model, opt, device):
    opt.step()
    for m in model.moe_layers():
        m.update_bias()
    if device == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def sample(model, prompt: bytes, n, seq, seed, device):
    g = torch.Generator().manual_seed(seed + 7)
    ids = list(prompt)
    for _ in range(n):
        ctx = torch.tensor([ids[-seq:]], device=device)
        logits = model(ctx)[0, -1].float().cpu()
        probs = torch.softmax(logits / 0.8, -1)
        ids.append(int(torch.multinomial(probs, 1, generator=g)))
    return bytes(ids).decode("utf-8", errors="replace")


def write_plot(path, loss_mg, loss_ref):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    steps = range(len(loss_mg))
    ax.plot(steps, loss_ref, label="plain PyTorch", lw=2.5, alpha=0.6)
    ax.plot(steps, loss_mg, label="moegrad ops", lw=1.0, ls="--")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats / byte)")
    ax.set_title("Tiny MoE byte-level LM: moegrad vs plain PyTorch")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("moegrad.demo: --device cuda asked for, but torch sees no CUDA device",
              file=sys.stderr)
        return 2
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if _DEV_STANDIN:
        print("moegrad.demo: WARNING: moegrad not importable, using the development stand-in",
              file=sys.stderr)

    data = load_text(args.data)
    batches = Batches(data, args.batch, args.seq, args.seed)

    torch.manual_seed(args.seed)
    ref = TinyMoELM(args, "torch")
    mg = TinyMoELM(args, "moegrad")
    mg.load_state_dict(copy.deepcopy(ref.state_dict()))
    ref.to(device)
    mg.to(device)
    opt_kw = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    opt_ref = torch.optim.AdamW(ref.parameters(), **opt_kw)
    opt_mg = torch.optim.AdamW(mg.parameters(), **opt_kw)

    n_params = sum(p.numel() for p in ref.parameters())
    print(f"moegrad.demo: {len(data):,} bytes of text, {n_params:,} parameters per model, "
          f"{args.layers} MoE layers x {args.experts} experts (top-{args.top_k}, "
          f"{args.groups} groups keep {args.topk_groups}), batch {args.batch}x{args.seq}, "
          f"{args.steps} steps on {device}", file=sys.stderr)

    loss_mg, loss_ref = [], []
    time_mg = time_ref = 0.0
    grad_diff0 = router_diff0 = expert_diff0 = float("nan")
    route_mismatch = 0
    first_mismatch = None
    bar = Progress(args.steps, enabled=not args.quiet)
    for step in range(args.steps):
        x, t = batches.next()
        x, t = x.to(device), t.to(device)
        lr = lr_at(step, args)

        l_mg, t0 = train_step(mg, opt_mg, x, t, lr, device)
        if step == 0:
            g_mg = None  # gradients are compared below, before either optimizer step
        else:
            finish_step(mg, opt_mg, device)
            time_mg += time.perf_counter() - t0
        l_ref, t0r = train_step(ref, opt_ref, x, t, lr, device)
        if step == 0:
            pa, pb = mg.moe_params(), ref.moe_params()
            grad_diff0 = grad_rel_diff(pa, pb)
            router_diff0 = grad_rel_diff(pa[0::3], pb[0::3])
            expert_diff0 = grad_rel_diff([p for i, p in enumerate(pa) if i % 3],
                                         [p for i, p in enumerate(pb) if i % 3])
            finish_step(ref, opt_ref, device)
            finish_step(mg, opt_mg, device)
        else:
            finish_step(ref, opt_ref, device)
            time_ref += time.perf_counter() - t0r

        for ma, mb in zip(mg.moe_layers(), ref.moe_layers()):
            same = (ma.last_idx.sort(-1).values == mb.last_idx.sort(-1).values).all(-1)
            nbad = int((~same).sum())
            route_mismatch += nbad
            if nbad and first_mismatch is None:
                first_mismatch = step
        loss_mg.append(l_mg.detach().item())
        loss_ref.append(l_ref.detach().item())
        bar.update(step, f"loss {loss_mg[-1]:.3f} / {loss_ref[-1]:.3f}")

    timed_steps = max(args.steps - 1, 1)
    tokens = args.batch * args.seq * timed_steps
    diffs = [abs(a - b) for a, b in zip(loss_mg, loss_ref)]
    max_diff = max(diffs)
    result = {
        "steps": args.steps,
        "loss_first": loss_mg[0],
        "loss_last": loss_mg[-1],
        "max_abs_loss_diff": max_diff,
        "grad_rel_diff_step0": grad_diff0,
        "tokens_per_s_moegrad": tokens / time_mg if time_mg > 0 else float("nan"),
        "tokens_per_s_reference": tokens / time_ref if time_ref > 0 else float("nan"),
        "grad_rel_diff_step0_router": router_diff0,
        "grad_rel_diff_step0_experts": expert_diff0,
        "routing_mismatched_tokens": route_mismatch,
        "first_routing_mismatch_step": first_mismatch,
        "loss_tol": LOSS_TOL,
        "grad_tol": GRAD_TOL,
    }
    ok = max_diff <= LOSS_TOL and grad_diff0 <= GRAD_TOL
    result["passed"] = bool(ok)

    rows = [
        ("", "moegrad", "plain PyTorch"),
        ("loss, first step", f"{loss_mg[0]:.4f}", f"{loss_ref[0]:.4f}"),
        ("loss, last step", f"{loss_mg[-1]:.4f}", f"{loss_ref[-1]:.4f}"),
        ("tokens / s (train)", f"{result['tokens_per_s_moegrad']:,.0f}",
         f"{result['tokens_per_s_reference']:,.0f}"),
    ]
    w0 = max(len(r[0]) for r in rows)
    out = sys.stdout
    print("", file=out)
    for r in rows:
        print(f"  {r[0]:<{w0}}  {r[1]:>12}  {r[2]:>14}", file=out)
    print(f"  max |loss diff| over {args.steps} steps: {max_diff:.2e}  (tolerance {LOSS_TOL:.0e})",
          file=out)
    print(f"  grad rel diff, step 0, MoE params: {grad_diff0:.2e}  (tolerance {GRAD_TOL:.0e}; "
          f"router {router_diff0:.1e}, experts {expert_diff0:.1e})", file=out)
    print(f"  tokens routed differently: {route_mismatch} of "
          f"{args.steps * args.layers * args.batch * args.seq} token-layer decisions", file=out)
    if args.sample > 0:
        prompt = b"The "
        text = sample(mg, prompt, args.sample, args.seq, args.seed, device)
        print("  sample (moegrad model):", file=out)
        for line in text.splitlines()[:8]:
            print("    | " + line, file=out)
    print(f"  result: {'PASS' if ok else 'FAIL'}: the two models "
          f"{'agree' if ok else 'DISAGREE'} within the fp32 tolerance", file=out)

    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        write_plot(args.plot, loss_mg, loss_ref)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
