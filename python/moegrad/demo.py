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

import moegrad

FORTUNES_DIR = "/usr/share/games/fortunes"

# Agreement thresholds (fp32). How they were measured and why they hold: docs/demo.md.
# Same-state checks (both models hold identical weights, same batch): only fp32 rounding differs.
SAME_LOSS_TOL = 1e-5     # |loss_moegrad - loss_reference|
GRAD_TOL = 2e-5          # ||g_moegrad - g_ref|| / ||g_ref||: all MoE parameters, and the routers
                         # and the expert weights each on their own (so a router error is not
                         # diluted by the larger expert gradients)
TIE_TOKENS_MAX = 4       # at most this many differently routed (token, layer) pairs = a tie
# Side-by-side training: each model follows its own trajectory; after the first routing tie the
# two trajectories separate. Two plain-PyTorch runs whose initial weights differ by one ulp
# (--calibrate) separate just as far (max 1.4e-2 .. 3.8e-2 in 7 runs of 400 and 1500 steps);
# this bound is that noise floor with a margin of 2.6.
LOSS_TOL = 1e-1          # max over all steps of |loss_moegrad - loss_reference|
# Expert-parallel run vs the single-process run of the same global batch (--ep, --compare):
# the same model and arithmetic, only the summation order of data-parallel gradients differs.
EP_LOSS_TOL = 1e-5


# ------------------------------------------------------------------------------------ data --

def load_text(path: str | None) -> bytes:
    """Bytes of the training text: ``path`` if given, else the plain fortunes files."""
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise SystemExit(f"moegrad.demo: cannot read --data {path!r}: {e.strerror}") from None
        if len(data) < 2:
            raise SystemExit(f"moegrad.demo: --data {path!r} holds {len(data)} bytes; need text")
        return data
    hint = ("moegrad.demo: no training text found. Without --data the demo trains on the "
            f"fortunes package ({FORTUNES_DIR}/*, not installed here). Either install it "
            "(Debian/Ubuntu: `sudo apt-get install fortunes`), or pass any UTF-8 text file of "
            "a few hundred kB or more with --data PATH (for example a book from Project "
            "Gutenberg).")
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


class TorchMoE(nn.Module):
    """The plain-PyTorch reference of the MoE FFN (DeepSeek-V3 routing), with the parameter
    and buffer names of moegrad.nn.MoE so that state dicts move between the two."""

    def __init__(self, d_model, d_expert, n_experts, top_k, n_groups, topk_groups,
                 routed_scale, bias_update):
        super().__init__()
        self.E, self.K, self.Fh = n_experts, top_k, d_expert
        self.n_groups, self.topk_groups = n_groups, topk_groups
        self.routed_scale, self.bias_update = routed_scale, bias_update
        self.gate = nn.Parameter(torch.randn(n_experts, d_model) * 0.02)
        self.w_up = nn.Parameter(torch.randn(n_experts, d_model, 2 * d_expert) / math.sqrt(d_model))
        self.w_down = nn.Parameter(torch.randn(n_experts, d_expert, d_model)
                                   / math.sqrt(d_expert) / 2)
        # Selection bias of aux-loss-free load balancing: used for ranking only, no gradient.
        self.register_buffer("selection_bias", torch.zeros(n_experts))
        self.register_buffer("tokens_per_expert", torch.zeros(n_experts))
        self.last_expert_idx = None

    def _gate(self, logits):
        T, E = logits.shape
        s = torch.sigmoid(logits)
        sel = (s + self.selection_bias).detach()
        gs = sel.view(T, self.n_groups, E // self.n_groups)
        gscore = gs.topk(2, dim=-1).values.sum(-1)                 # top-2 sum per group
        gidx = gscore.topk(self.topk_groups, dim=-1).indices
        gmask = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, gidx, True)
        sel = sel.masked_fill(~gmask.repeat_interleave(E // self.n_groups, 1), float("-inf"))
        idx = sel.topk(self.K, dim=-1).indices
        g = s.gather(1, idx)
        y = g / (g.sum(-1, keepdim=True) + 1e-20) * self.routed_scale
        return y, idx

    def forward(self, h):
        shape = h.shape
        h = h.reshape(-1, shape[-1])
        y, idx = self._gate(F.linear(h, self.gate))
        order, row_idx, counts, tok = route_permutation(idx, self.E)
        self.last_expert_idx = idx
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert += counts.float()
        xs = h[tok]
        sizes = counts.tolist()
        up = torch.cat([xe @ self.w_up[e] for e, xe in enumerate(xs.split(sizes))])
        act = F.silu(up[:, :self.Fh]) * up[:, self.Fh:]
        expanded = torch.cat([ae @ self.w_down[e] for e, ae in enumerate(act.split(sizes))])
        scale = y.t().reshape(-1)[order]
        out = torch.zeros_like(h).index_add_(0, tok, expanded * scale[:, None])
        return out.reshape(shape)

    @torch.no_grad()
    def update_bias(self):
        """Aux-loss-free balancing: push under-loaded experts up, over-loaded ones down."""
        load = self.tokens_per_expert.clone()
        self.selection_bias += self.bias_update * torch.sign(load.mean() - load)
        self.tokens_per_expert.zero_()


def moe_ffn(cfg, impl, ep_group=None):
    """The MoE FFN of one block: moegrad.nn.MoE ("moegrad") or its plain-PyTorch twin."""
    if impl == "moegrad":
        return moegrad.nn.MoE(cfg.d_model, cfg.d_expert, cfg.experts, cfg.top_k, score="sigmoid",
                              n_group=cfg.groups, topk_group=cfg.topk_groups,
                              routed_scaling_factor=cfg.routed_scale,
                              bias_update_speed=cfg.bias_update, ep_group=ep_group)
    return TorchMoE(cfg.d_model, cfg.d_expert, cfg.experts, cfg.top_k, cfg.groups,
                    cfg.topk_groups, cfg.routed_scale, cfg.bias_update)


class Block(nn.Module):
    def __init__(self, cfg, impl, ep_group=None):
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.norm1 = nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.norm2 = nn.RMSNorm(d)
        self.moe = moe_ffn(cfg, impl, ep_group)

    def forward(self, x):
        B, S, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, S, 3, self.n_heads, D // self.n_heads) \
            .permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, S, D))
        x = x + self.moe(self.norm2(x))             # residual add outside the finalize op
        return x


class TinyMoELM(nn.Module):
    def __init__(self, cfg, impl, ep_group=None):
        super().__init__()
        self.tok = nn.Embedding(256, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)
        self.blocks = nn.ModuleList([Block(cfg, impl, ep_group) for _ in range(cfg.layers)])
        self.norm = nn.RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, 256, bias=False)

    def forward(self, idx, targets=None, loss_denominator=None):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        if loss_denominator is None:
            return F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))
        # A share of a global mean (expert parallelism: the ranks' shares add up to it).
        return F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1),
                               reduction="sum") / loss_denominator

    def moe_layers(self):
        return [b.moe for b in self.blocks]

    def moe_params(self):
        return [p for m in self.moe_layers() for p in (m.gate, m.w_up, m.w_down)]


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


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.help is None:
            return action.help
        return super()._get_help_string(action)


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m moegrad.demo",
        description="Train a tiny byte-level MoE language model whose MoE layers run on moegrad "
                    "ops, side by side with the same model in plain PyTorch, and check that both "
                    "agree. See docs/demo.md.",
        formatter_class=_HelpFormatter)
    p.add_argument("--steps", type=int, default=400, help="training steps")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to train")
    p.add_argument("--data", default=None, metavar="PATH",
                   help=f"text file to train on (default: the plain files in {FORTUNES_DIR})")
    p.add_argument("--seed", type=int, default=0, help="initialisation, batches and sampling")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG of both loss curves")
    g = p.add_argument_group("model size")
    g.add_argument("--batch", type=int, default=32, help="sequences per batch")
    g.add_argument("--seq", type=int, default=64, help="bytes per sequence (context length)")
    g.add_argument("--d-model", type=int, default=64, help="model width")
    g.add_argument("--n-heads", type=int, default=4, help="attention heads")
    g.add_argument("--layers", type=int, default=2, help="transformer blocks (one MoE each)")
    g.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer")
    g.add_argument("--groups", type=int, default=4, help="expert groups")
    g.add_argument("--topk-groups", type=int, default=2, help="groups kept per token")
    g.add_argument("--top-k", type=int, default=2, help="experts per token")
    g.add_argument("--d-expert", type=int, default=128, help="expert hidden size F")
    g.add_argument("--routed-scale", type=float, default=1.0,
                   help="routed_scaling_factor applied to the router weights")
    o = p.add_argument_group("optimisation and checks")
    o.add_argument("--lr", type=float, default=5e-3,
                   help="AdamW peak learning rate (linear warm-up, cosine decay to 10%%)")
    o.add_argument("--warmup", type=int, default=20, help="warm-up steps")
    o.add_argument("--bias-update", type=float, default=1e-3,
                   help="aux-loss-free selection-bias step u (DeepSeek-V3)")
    o.add_argument("--check-every", type=int, default=25,
                   help="run a same-state check every N steps (and at steps 0 and last)")
    o.add_argument("--calibrate", action="store_true",
                   help="measure the fp32 noise floor: replace the moegrad model by a plain "
                        "PyTorch copy whose initial weights differ by one ulp (no pass/fail)")
    o.add_argument("--threads", type=int, default=0,
                   help="CPU threads for torch and moegrad (0: leave as is)")
    o.add_argument("--quiet", action="store_true", help="no progress bar")
    o.add_argument("--ep", type=int, default=1,
                   help="expert-parallel ranks: run under torchrun --nproc-per-node N; each "
                        "rank holds experts/N experts and batch/N sequences of the same global "
                        "batch (moegrad model only, no side-by-side reference)")
    o.add_argument("--compare", default=None, metavar="JSON",
                   help="the JSON of another run: fail unless every step's loss matches it "
                        f"within {EP_LOSS_TOL:g}")
    o.add_argument("--sample", type=int, default=160,
                   help="bytes of text to sample from the moegrad model at the end (0: none)")
    h = p.add_argument_group("a transformers architecture (needs moegrad[hf]; docs/hf.md)")
    h.add_argument("--hf", default=None, metavar="ARCH",
                   help="train a small transformers model of this architecture instead, "
                        "patched by moegrad.hf and unpatched: qwen3_moe, qwen2_moe, olmoe, "
                        "mixtral, deepseek_v3, gpt_oss, deepseek_v4")
    h.add_argument("--hf-baseline", default="grouped_mm",
                   choices=["grouped_mm", "eager", "batched_mm"],
                   help="the unpatched model's experts implementation")
    a = p.parse_args(argv)
    if a.d_model % a.n_heads:
        p.error("--d-model must be a multiple of --n-heads")
    if a.groups < 1 or a.experts % a.groups or a.experts // a.groups < 2:
        p.error("--experts must be a multiple of --groups with at least 2 experts per group "
                "(groups are ranked by the sum of their two best scores)")
    if not 1 <= a.topk_groups <= a.groups:
        p.error("--topk-groups must be in [1, --groups]")
    if not 1 <= a.top_k <= a.topk_groups * (a.experts // a.groups):
        p.error("--top-k must be in [1, --topk-groups * experts per group]")
    if a.steps < 1:
        p.error("--steps must be >= 1")
    if a.check_every < 1:
        p.error("--check-every must be >= 1")
    if a.seq < 1 or a.batch < 1:
        p.error("--seq and --batch must be >= 1")
    if a.ep < 1 or a.batch % a.ep or a.experts % a.ep:
        p.error("--ep must be >= 1 and divide --batch and --experts")
    hf_archs = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v3", "gpt_oss",
                "deepseek_v4")
    if a.hf is not None and a.hf not in hf_archs:
        p.error(f"--hf must be one of {', '.join(hf_archs)}; got {a.hf!r}")
    if a.hf is not None and (a.ep > 1 or a.calibrate or a.compare):
        p.error("--hf trains on one process without --calibrate / --compare")
    return a


def lr_at(step, args):
    """Linear warm-up, then cosine decay to 10% of --lr."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(args.steps - args.warmup, 1)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def grad_rel_diff(pa, pb):
    """||g_a - g_b|| / ||g_b|| over a list of parameters, in float64."""
    num = sum(float((a.grad.double() - b.grad.double()).pow(2).sum()) for a, b in zip(pa, pb))
    den = sum(float(b.grad.double().pow(2).sum()) for b in pb)
    return math.sqrt(num) / max(math.sqrt(den), 1e-300)


def routing_mismatch(model_a, model_b):
    """Number of (token, layer) pairs whose selected expert sets differ in the last forward."""
    n = 0
    for ma, mb in zip(model_a.moe_layers(), model_b.moe_layers()):
        same = (ma.last_expert_idx.long().sort(-1).values
                == mb.last_expert_idx.long().sort(-1).values).all(-1)
        n += int((~same).sum())
    return n


def fwd_bwd(model, x, t):
    model.zero_grad(set_to_none=True)
    loss = model(x, t)
    loss.backward()
    return loss.detach().item()


def opt_step(model, opt, lr):
    for g in opt.param_groups:
        g["lr"] = lr
    opt.step()
    for m in model.moe_layers():
        m.update_bias()


def _nanmax(values):
    """max() that returns NaN if any value is NaN, None if there are none."""
    values = list(values)
    if not values:
        return None
    return float("nan") if any(math.isnan(v) for v in values) else max(values)


GRAD_KEYS = ("grad_rel_diff", "grad_rel_diff_router", "grad_rel_diff_experts")


def same_state_check(step, a, b, loss_a, loss_b):
    """Compare two models that hold identical parameters and saw the same batch."""
    pa, pb = a.moe_params(), b.moe_params()
    c = {
        "step": step,
        "loss_diff": abs(loss_a - loss_b),
        "grad_rel_diff": grad_rel_diff(pa, pb),
        "grad_rel_diff_router": grad_rel_diff(pa[0::3], pb[0::3]),
        "grad_rel_diff_experts": grad_rel_diff([p for i, p in enumerate(pa) if i % 3],
                                               [p for i, p in enumerate(pb) if i % 3]),
        "routing_mismatch": routing_mismatch(a, b),
    }
    grads_ok = all(c[k] <= GRAD_TOL for k in GRAD_KEYS)        # False for NaN
    if c["routing_mismatch"] == 0:
        c["status"] = "ok" if c["loss_diff"] <= SAME_LOSS_TOL and grads_ok else "FAIL"
    elif c["routing_mismatch"] <= TIE_TOKENS_MAX:
        c["status"] = "tie"           # an fp32 routing tie: the two models legitimately differ
    else:
        c["status"] = "FAIL"
    return c


@torch.no_grad()
def sample(model, prompt: bytes, n, seq, seed, device):
    g = torch.Generator().manual_seed(seed + 7)
    ids = list(prompt)
    for _ in range(n):
        ctx = torch.tensor([ids[-seq:]], device=device)
        logits = model(ctx)[0, -1].float().cpu()
        probs = torch.softmax(logits / 0.8, -1)
        ids.append(int(torch.multinomial(probs, 1, generator=g)))
    return printable(bytes(ids))


def printable(data: bytes) -> str:
    """The sampled bytes as text a terminal shows cleanly: invalid or cut multi-byte UTF-8
    sequences are dropped (no replacement characters), other control characters become
    spaces, line breaks and tabs stay."""
    text = data.decode("utf-8", errors="ignore")
    return "".join(c if c.isprintable() or c in "\n\t" else " " for c in text)


def write_plot(path, loss_a, loss_b, label_a, first_mismatch=None, label_b="plain PyTorch",
               title="Tiny MoE byte-level LM: moegrad ops vs plain PyTorch"):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7, 5.5), dpi=110, sharex=True,
                                  gridspec_kw={"height_ratios": [3, 1]})
    steps = range(len(loss_a))
    ax.plot(steps, loss_b, label=label_b, lw=2.5, alpha=0.55)
    ax.plot(steps, loss_a, label=label_a, lw=1.0, ls="--")
    ax.set_ylabel("training loss (nats / byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    ax2.semilogy(steps, [max(abs(x - y), 1e-9) for x, y in zip(loss_a, loss_b)], lw=1.0)
    ax2.axhline(LOSS_TOL, color="r", lw=0.8, ls=":", label=f"tolerance {LOSS_TOL:g}")
    if first_mismatch is not None:
        ax2.axvline(first_mismatch, color="gray", lw=0.8, ls="--",
                    label=f"first routing difference (step {first_mismatch})")
        ax.axvline(first_mismatch, color="gray", lw=0.8, ls="--")
    ax2.set_ylabel("|loss diff|\n(0 drawn as 1e-9)", fontsize=8)
    ax2.set_xlabel("step")
    ax2.grid(alpha=0.3)
    ax2.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def build_models(args, device):
    torch.manual_seed(args.seed)
    ref = TinyMoELM(args, "torch")
    other = TinyMoELM(args, "torch" if args.calibrate else "moegrad")
    state = copy.deepcopy(ref.state_dict())
    if args.calibrate:
        # A one-ulp relative nudge of every initial weight: the smallest possible difference.
        g = torch.Generator().manual_seed(args.seed + 3)
        for k, v in state.items():
            if v.is_floating_point() and "selection_bias" not in k and "tokens_per" not in k:
                sign = torch.randint(0, 2, v.shape, generator=g).to(v.dtype) * 2 - 1
                state[k] = v * (1 + sign * 2.0 ** -23)
    other.load_state_dict(state)
    return other.to(device), ref.to(device)


def check_outputs(args) -> str | None:
    """Everything that could fail after training is checked before it: the optional plotting
    dependency and the folders of the output files. Returns an error message or None."""
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return ("moegrad.demo: --plot needs matplotlib, which is not installed. Install the "
                    "demo extra: `pip install 'moegrad[demo]'` (from a source checkout: "
                    "`pip install '.[demo]'`), or `pip install matplotlib`; or drop --plot.")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder):
                return f"moegrad.demo: {flag} {path!r}: the folder {folder!r} does not exist"
    return None


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    problem = check_outputs(args)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("moegrad.demo: --device cuda asked for, but torch sees no CUDA device",
              file=sys.stderr)
        return 2
    threads_before = (torch.get_num_threads(), moegrad.get_num_threads())
    if args.threads > 0:
        torch.set_num_threads(args.threads)
        moegrad.set_num_threads(args.threads)
    try:
        if args.hf is not None:
            from moegrad import _demo_hf
            return _demo_hf.run(args, device)
        if args.ep > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return _run_ep(args, device)
        return _run(args, device)
    except moegrad.MoeError as e:
        if device != "cuda":
            raise
        print(f"moegrad.demo: moegrad rejected the CUDA tensors ({e}); this build of moegrad "
              "may be CPU-only, run with --device cpu", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads_before[0])
        moegrad.set_num_threads(threads_before[1])


def _run(args, device) -> int:

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    data = load_text(args.data)
    batches = Batches(data, args.batch, args.seq, args.seed)
    mg, ref = build_models(args, device)
    shadow = TinyMoELM(args, "torch").to(device)     # scratch copy for the same-state checks
    opt_kw = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    opt_mg = torch.optim.AdamW(mg.parameters(), **opt_kw)
    opt_ref = torch.optim.AdamW(ref.parameters(), **opt_kw)
    label = "plain PyTorch, 1-ulp nudged init" if args.calibrate else "moegrad ops"

    n_params = sum(p.numel() for p in ref.parameters())
    print(f"moegrad.demo: {len(data):,} bytes of text, {n_params:,} parameters per model, "
          f"{args.layers} MoE layers x {args.experts} experts (top-{args.top_k}, "
          f"{args.groups} groups keep {args.topk_groups}), batch {args.batch}x{args.seq}, "
          f"{args.steps} steps on {device}" + (" [calibration run]" if args.calibrate else ""),
          file=sys.stderr)

    loss_mg, loss_ref, checks = [], [], []
    time_mg = time_ref = 0.0
    mismatched = 0
    first_mismatch = None
    bar = Progress(args.steps, enabled=not args.quiet)
    for step in range(args.steps):
        x, t = batches.next()
        x, t = x.to(device), t.to(device)
        lr = lr_at(step, args)

        sync()
        t0 = time.perf_counter()
        l_mg = fwd_bwd(mg, x, t)
        sync()
        t1 = time.perf_counter()
        l_ref = fwd_bwd(ref, x, t)
        sync()
        t2 = time.perf_counter()
        # Same-state checks, before either optimizer step. At step 0 both models hold the
        # same weights; later a plain-PyTorch copy of the moegrad model's current state
        # (weights and selection biases) recomputes the step.
        if step == 0:
            checks.append(same_state_check(0, mg, ref, l_mg, l_ref))
        elif step % args.check_every == 0 or step == args.steps - 1:
            shadow.load_state_dict(mg.state_dict())
            l_sh = fwd_bwd(shadow, x, t)
            checks.append(same_state_check(step, mg, shadow, l_mg, l_sh))
        mismatch = routing_mismatch(mg, ref)
        mismatched += mismatch
        if mismatch and first_mismatch is None:
            first_mismatch = step
        sync()
        t3 = time.perf_counter()
        opt_step(mg, opt_mg, lr)
        sync()
        t4 = time.perf_counter()
        opt_step(ref, opt_ref, lr)
        sync()
        t5 = time.perf_counter()
        if step > 0 or args.steps == 1:             # step 0 pays one-time warm-up costs
            time_mg += (t1 - t0) + (t4 - t3)
            time_ref += (t2 - t1) + (t5 - t4)
        loss_mg.append(l_mg)
        loss_ref.append(l_ref)
        bar.update(step, f"loss {'nudged' if args.calibrate else 'moegrad'} {l_mg:.3f} / "
                   f"PyTorch {l_ref:.3f}")

    timed_steps = max(args.steps - 1, 1)
    tokens = args.batch * args.seq * timed_steps
    diffs = [abs(a - b) for a, b in zip(loss_mg, loss_ref)]
    max_diff = _nanmax(diffs)
    c0 = checks[0]
    compared = [c for c in checks if c["status"] != "tie"]
    failed = [c for c in checks if c["status"] == "FAIL"]
    ok_grad0 = c0["status"] == "tie" or all(c0[k] <= GRAD_TOL for k in GRAD_KEYS)
    ok = (max_diff <= LOSS_TOL and ok_grad0 and not failed and len(compared) > 0)
    reasons = []
    if not max_diff <= LOSS_TOL:
        reasons.append(f"max |loss diff| {max_diff:.2e} > {LOSS_TOL:g}")
    if not ok_grad0:
        reasons.append(f"step-0 gradients differ (rel {c0['grad_rel_diff']:.2e}, router "
                       f"{c0['grad_rel_diff_router']:.2e}, experts "
                       f"{c0['grad_rel_diff_experts']:.2e}; tolerance {GRAD_TOL:g})")
    for c in failed:
        reasons.append(f"same-state check at step {c['step']}: loss diff {c['loss_diff']:.2e}, "
                       f"grad rel diff {c['grad_rel_diff']:.2e} (router "
                       f"{c['grad_rel_diff_router']:.2e}), {c['routing_mismatch']} tokens routed "
                       "differently")
    if not compared:
        reasons.append("every same-state check hit a routing tie: nothing was compared")
    if args.calibrate:
        ok = True                                     # a measurement, not a check
        reasons = []

    result = {
        "steps": args.steps,
        "loss_first": loss_mg[0],
        "loss_last": loss_mg[-1],
        "max_abs_loss_diff": max_diff,
        "grad_rel_diff_step0": c0["grad_rel_diff"],
        "tokens_per_s_moegrad": tokens / time_mg if time_mg > 0 else float("nan"),
        "tokens_per_s_reference": tokens / time_ref if time_ref > 0 else float("nan"),
        "passed": bool(ok),
        "failures": reasons,
        "loss_first_reference": loss_ref[0],
        "loss_last_reference": loss_ref[-1],
        "loss_last10_mean": sum(loss_mg[-10:]) / len(loss_mg[-10:]),
        "loss_last10_mean_reference": sum(loss_ref[-10:]) / len(loss_ref[-10:]),
        "grad_rel_diff_step0_router": c0["grad_rel_diff_router"],
        "grad_rel_diff_step0_experts": c0["grad_rel_diff_experts"],
        "same_state_checks": checks,
        "same_state_max_loss_diff": _nanmax(c["loss_diff"] for c in compared),
        "same_state_max_grad_rel_diff": _nanmax(c[k] for c in compared for k in GRAD_KEYS),
        "routing_mismatched_tokens": mismatched,
        "first_routing_mismatch_step": first_mismatch,
        "tolerances": {"max_abs_loss_diff": LOSS_TOL, "grad_rel_diff": GRAD_TOL,
                       "same_state_loss_diff": SAME_LOSS_TOL,
                       "tie_tokens_max": TIE_TOKENS_MAX},
        "calibration_run": bool(args.calibrate),
        "losses": loss_mg,
        "losses_reference": loss_ref,
        "args": vars(args),
    }

    out = sys.stdout
    rows = [
        ("", label.split(",")[0], "plain PyTorch"),
        ("loss, step 0", f"{loss_mg[0]:.4f}", f"{loss_ref[0]:.4f}"),
    ]
    if args.steps > 1:
        rows += [
            (f"loss, step {args.steps - 1}", f"{loss_mg[-1]:.4f}", f"{loss_ref[-1]:.4f}"),
            (f"loss, mean of last {min(10, args.steps)}", f"{result['loss_last10_mean']:.4f}",
             f"{result['loss_last10_mean_reference']:.4f}"),
        ]
    rows += [
        ("tokens / s (training)", f"{result['tokens_per_s_moegrad']:,.0f}",
         f"{result['tokens_per_s_reference']:,.0f}"),
    ]
    w0 = max(len(r[0]) for r in rows)
    print("", file=out)
    for r in rows:
        print(f"  {r[0]:<{w0}}  {r[1]:>14}  {r[2]:>14}", file=out)
    print("", file=out)
    print(f"  max |loss diff| over {args.steps} steps    {max_diff:9.2e}   tolerance "
          f"{LOSS_TOL:.0e}", file=out)
    print(f"  grad rel diff at step 0 (MoE params) {c0['grad_rel_diff']:9.2e}   tolerance "
          f"{GRAD_TOL:.0e}   (router {c0['grad_rel_diff_router']:.1e}, experts "
          f"{c0['grad_rel_diff_experts']:.1e})", file=out)
    sl = result["same_state_max_loss_diff"]
    sg = result["same_state_max_grad_rel_diff"]
    print(f"  same-state checks {len(checks)} (steps {checks[0]['step']}.."
          f"{checks[-1]['step']}): max loss diff "
          f"{'-' if sl is None else f'{sl:.1e}'} (tol {SAME_LOSS_TOL:.0e}), max grad rel diff "
          f"{'-' if sg is None else f'{sg:.1e}'} (tol {GRAD_TOL:.0e}), "
          f"ties {len(checks) - len(compared)}, failed {len(failed)}", file=out)
    total = args.steps * args.layers * args.batch * args.seq
    print(f"  token-layer routings that differ between the two trained models: {mismatched:,} "
          f"of {total:,}" + (f" (first at step {first_mismatch})" if first_mismatch is not None
                              else ""), file=out)
    if args.sample > 0:
        text = sample(mg, b"The ", args.sample, args.seq, args.seed, device)
        print(f"  sample from the {label.split(',')[0]} model:", file=out)
        for line in text.splitlines()[:8]:
            print("    | " + line, file=out)
    if args.calibrate:
        print("  result: calibration run (no pass/fail)", file=out)
    else:
        print(f"  result: {'PASS' if ok else 'FAIL'}: moegrad and plain PyTorch "
              f"{'agree within' if ok else 'DISAGREE beyond'} the fp32 tolerances", file=out)
        for r in reasons:
            print(f"    - {r}", file=out)

    if args.compare:
        ok = _compare(args.compare, loss_mg, result, out) and ok
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"  wrote {args.json} (results as JSON)", file=out)
    if args.plot:
        write_plot(args.plot, loss_mg, loss_ref, label, first_mismatch)
        print(f"  wrote {args.plot} (loss curves)", file=out)
    return 0 if ok else 1


def _compare(path, losses, result, out) -> bool:
    """Step-by-step loss comparison with another run's JSON (--compare)."""
    with open(path) as f:
        other = json.load(f)["losses"]
    n = min(len(other), len(losses))
    diffs = [abs(a - b) for a, b in zip(losses[:n], other[:n])]
    worst = _nanmax(diffs) if diffs else float("nan")
    ok = n == len(losses) == len(other) and worst <= EP_LOSS_TOL
    result["compare"] = {"path": path, "steps": n, "max_abs_loss_diff": worst,
                         "tolerance": EP_LOSS_TOL, "passed": bool(ok)}
    print(f"  vs {path}: max |loss diff| over {n} steps {worst:.2e} (tolerance "
          f"{EP_LOSS_TOL:g}): {'PASS' if ok else 'FAIL'}", file=out)
    return ok


def _run_ep(args, device) -> int:
    """Expert-parallel training under torchrun: experts split over the ranks, each rank trains
    on its slice of the same global batch; the loss is the global mean (rank 0 reports)."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.ep:
        print(f"moegrad.demo: --ep {args.ep} needs {args.ep} processes (WORLD_SIZE is {world}): "
              f"run .venv/bin/torchrun --standalone --nproc-per-node {args.ep} -m moegrad.demo "
              f"--ep {args.ep}, or make demo-ep EP={args.ep}", file=sys.stderr)
        return 2
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank = dist.get_rank()
    try:
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            device = f"cuda:{torch.cuda.current_device()}"
        data = load_text(args.data)
        batches = Batches(data, args.batch, args.seq, args.seed)
        # The single-process initialisation (same seed, same draws), then this rank's experts.
        ref, _ = build_models(args, "cpu")
        state = ref.state_dict()
        mg = TinyMoELM(args, "moegrad", ep_group=dist.group.WORLD)
        El = args.experts // world
        for k in list(state):
            if k.endswith(".w_up") or k.endswith(".w_down"):
                state[k] = state[k][rank * El:(rank + 1) * El].clone()
        mg.load_state_dict(state)
        mg = mg.to(device)
        opt = torch.optim.AdamW(mg.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                weight_decay=0.01)
        B = args.batch // world
        denom = float(args.batch * args.seq)
        losses = []
        t_train = 0.0
        bar = Progress(args.steps, enabled=not args.quiet and rank == 0)
        for step in range(args.steps):
            x, t = batches.next()
            x = x[rank * B:(rank + 1) * B].to(device)
            t = t[rank * B:(rank + 1) * B].to(device)
            t0 = time.perf_counter()
            mg.zero_grad(set_to_none=True)
            loss = mg(x, t, loss_denominator=denom)
            loss.backward()
            moegrad.nn.all_reduce_non_expert_grads(mg)
            total = loss.detach().clone()
            dist.all_reduce(total)
            opt_step(mg, opt, lr_at(step, args))
            if step > 0 or args.steps == 1:
                t_train += time.perf_counter() - t0
            losses.append(float(total))
            bar.update(step, f"loss {losses[-1]:.3f}")
        if rank != 0:
            # Leave together with rank 0 (after its report), so that no rank tears gloo's
            # connections down while another still holds them.
            dist.barrier()
            return 0
        timed = max(args.steps - 1, 1)
        result = {
            "steps": args.steps, "ep": world, "loss_first": losses[0], "loss_last": losses[-1],
            "loss_last10_mean": sum(losses[-10:]) / len(losses[-10:]),
            "tokens_per_s_moegrad": args.batch * args.seq * timed / t_train
            if t_train > 0 else float("nan"),
            "passed": True, "failures": [], "losses": losses, "args": vars(args),
        }
        out = sys.stdout
        print(f"\n  expert-parallel run: {world} ranks x {El} experts, global batch "
              f"{args.batch}x{args.seq}", file=out)
        print(f"  loss, step 0 {losses[0]:.6f}; step {args.steps - 1} {losses[-1]:.6f}; "
              f"{result['tokens_per_s_moegrad']:,.0f} tokens/s", file=out)
        ok = True
        if args.compare:
            ok = _compare(args.compare, losses, result, out)
            result["passed"] = ok
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        if args.plot:
            write_plot(args.plot, losses, losses, f"moegrad, {world} expert-parallel ranks")
        dist.barrier()
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
