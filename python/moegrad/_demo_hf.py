"""`python -m moegrad.demo --hf ARCH`: a small transformers model of architecture ARCH trained on
the demo's text twice, patched by moegrad.hf and unpatched (transformers' own experts backend),
from the same initial weights and batches (docs/demo.md "A transformers architecture",
docs/hf.md).

Reported side by side, in the table, the JSON and the plot: both loss curves and the training
tokens/s of each. Checked: at step 0 (identical weights) and at the last step (the baseline
recomputing the patched model's state) the loss and the MoE gradients agree to fp32 rounding,
and the two loss curves stay within the demo's trajectory tolerance.
"""
from __future__ import annotations

import copy
import json
import sys
import time

import torch
import torch.nn.functional as F

from moegrad import demo as _demo


def _moe_params(model):
    """(router parameters, expert parameters) of the MoE blocks, by name, in model order."""
    router, experts = [], []
    for name, p in model.named_parameters():
        if ".experts." in name or "shared_expert" in name:
            experts.append(p)
        elif ".gate." in name or ".router." in name:
            router.append(p)
    return router, experts


def _selections(model):
    """Forward hooks recording each router call's sorted expert ids (cleared per step)."""
    seen = []

    def hook(_m, _i, out):
        seen.append(torch.sort(out[2].detach().long(), dim=-1).values)
    for m in model.modules():
        if type(m).__name__.endswith(("TopKRouter", "TopkRouter", "HashRouter")):
            m.register_forward_hook(hook)
    return seen


def _mismatch(a, b) -> int:
    return sum(int((~(x == y).all(-1)).sum()) for x, y in zip(a, b))


def _fwd_bwd(model, x, t, seen):
    seen.clear()
    model.zero_grad(set_to_none=True)
    logits = model(x).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), t.reshape(-1))
    loss.backward()
    return loss.detach().item()


def _check(step, a, b, la, lb, sel_a, sel_b):
    ra, ea = _moe_params(a)
    rb, eb = _moe_params(b)
    c = {"step": step, "loss_diff": abs(la - lb),
         "grad_rel_diff": _demo.grad_rel_diff(ra + ea, rb + eb),
         "grad_rel_diff_router": _demo.grad_rel_diff(ra, rb),
         "grad_rel_diff_experts": _demo.grad_rel_diff(ea, eb),
         "routing_mismatch": _mismatch(sel_a, sel_b)}
    grads_ok = all(c[k] <= _demo.GRAD_TOL for k in _demo.GRAD_KEYS)
    if c["routing_mismatch"] == 0:
        c["status"] = "ok" if c["loss_diff"] <= _demo.SAME_LOSS_TOL and grads_ok else "FAIL"
    else:
        c["status"] = "tie" if c["routing_mismatch"] <= _demo.TIE_TOKENS_MAX else "FAIL"
    return c


def run(args, device) -> int:
    import transformers as tf

    import moegrad.hf as mh

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    data = _demo.load_text(args.data)
    batches = _demo.Batches(data, args.batch, args.seq, args.seed)
    torch.manual_seed(args.seed)
    cfg = mh.small_config(args.hf, hidden=args.d_model, intermediate=args.d_expert,
                          experts=args.experts, top_k=args.top_k, layers=args.layers, vocab=256,
                          heads=args.n_heads, max_positions=max(args.seq, 64))
    base = tf.AutoModelForCausalLM.from_config(
        cfg, experts_implementation=args.hf_baseline).to(device).train()
    patched = copy.deepcopy(base)
    shadow = copy.deepcopy(base)               # scratch baseline for the last-step check
    report = mh.apply(patched)
    sel_p, sel_b, sel_s = _selections(patched), _selections(base), _selections(shadow)
    opt_kw = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    opt_p = torch.optim.AdamW(patched.parameters(), **opt_kw)
    opt_b = torch.optim.AdamW(base.parameters(), **opt_kw)
    label_p, label_b = "moegrad.hf", f"transformers {args.hf_baseline}"
    n_params = sum(p.numel() for p in base.parameters())
    print(f"moegrad.demo --hf {args.hf}: {len(data):,} bytes of text, {n_params:,} parameters "
          f"per model, {args.layers} MoE layers x {args.experts} experts (top-{args.top_k}), "
          f"batch {args.batch}x{args.seq}, {args.steps} steps on {device}; baseline: "
          f"{label_b}\n{report}", file=sys.stderr)

    loss_p, loss_b, checks = [], [], []
    time_p = time_b = 0.0
    mismatched, first_mismatch = 0, None
    bar = _demo.Progress(args.steps, enabled=not args.quiet)
    for step in range(args.steps):
        x, t = batches.next()
        x, t = x.to(device), t.to(device)
        lr = _demo.lr_at(step, args)
        sync()
        t0 = time.perf_counter()
        lp = _fwd_bwd(patched, x, t, sel_p)
        sync()
        t1 = time.perf_counter()
        lb = _fwd_bwd(base, x, t, sel_b)
        sync()
        t2 = time.perf_counter()
        if step == 0:
            checks.append(_check(0, patched, base, lp, lb, sel_p, sel_b))
        elif step == args.steps - 1:
            shadow.load_state_dict(patched.state_dict())
            ls = _fwd_bwd(shadow, x, t, sel_s)
            checks.append(_check(step, patched, shadow, lp, ls, sel_p, sel_s))
        mismatch = _mismatch(sel_p, sel_b)
        mismatched += mismatch
        if mismatch and first_mismatch is None:
            first_mismatch = step
        sync()
        t3 = time.perf_counter()
        for opt in (opt_p, opt_b):
            for g in opt.param_groups:
                g["lr"] = lr
        opt_p.step()
        sync()
        t4 = time.perf_counter()
        opt_b.step()
        sync()
        t5 = time.perf_counter()
        if step > 0 or args.steps == 1:
            time_p += (t1 - t0) + (t4 - t3)
            time_b += (t2 - t1) + (t5 - t4)
        loss_p.append(lp)
        loss_b.append(lb)
        bar.update(step, f"loss {label_p} {lp:.3f} / {args.hf_baseline} {lb:.3f}")

    tokens = args.batch * args.seq * max(args.steps - 1, 1)
    max_diff = _demo._nanmax(abs(a - b) for a, b in zip(loss_p, loss_b))
    failed = [c for c in checks if c["status"] == "FAIL"]
    compared = [c for c in checks if c["status"] != "tie"]
    reasons = [f"max |loss diff| {max_diff:.2e} > {_demo.LOSS_TOL:g}"] \
        if not max_diff <= _demo.LOSS_TOL else []
    for c in failed:
        reasons.append(f"same-state check at step {c['step']}: loss diff {c['loss_diff']:.2e}, "
                       f"grad rel diff {c['grad_rel_diff']:.2e}, {c['routing_mismatch']} "
                       f"tokens routed differently")
    if not compared:
        reasons.append("every same-state check hit a routing tie: nothing was compared")
    ok = not reasons
    tps_p = tokens / time_p if time_p > 0 else float("nan")
    tps_b = tokens / time_b if time_b > 0 else float("nan")
    c0 = checks[0]
    result = {
        "steps": args.steps, "hf_arch": args.hf, "hf_baseline": args.hf_baseline,
        "loss_first": loss_p[0], "loss_last": loss_p[-1],
        "loss_first_reference": loss_b[0], "loss_last_reference": loss_b[-1],
        "max_abs_loss_diff": max_diff, "grad_rel_diff_step0": c0["grad_rel_diff"],
        "tokens_per_s_moegrad": tps_p, "tokens_per_s_reference": tps_b,
        "speedup": tps_p / tps_b if tps_b > 0 else float("nan"),
        "passed": ok, "failures": reasons, "same_state_checks": checks,
        "routing_mismatched_tokens": mismatched, "first_routing_mismatch_step": first_mismatch,
        "patched": [vars(e) for e in report.patched],
        "left_alone": [vars(e) for e in report.left_alone],
        "tolerances": {"max_abs_loss_diff": _demo.LOSS_TOL, "grad_rel_diff": _demo.GRAD_TOL,
                       "same_state_loss_diff": _demo.SAME_LOSS_TOL},
        "losses": loss_p, "losses_reference": loss_b, "args": vars(args),
    }
    out = sys.stdout
    rows = [("", label_p, label_b),
            ("loss, step 0", f"{loss_p[0]:.4f}", f"{loss_b[0]:.4f}"),
            (f"loss, step {args.steps - 1}", f"{loss_p[-1]:.4f}", f"{loss_b[-1]:.4f}"),
            ("tokens / s (training)", f"{tps_p:,.0f}", f"{tps_b:,.0f}")]
    w0 = max(len(r[0]) for r in rows)
    print("", file=out)
    for r in rows:
        print(f"  {r[0]:<{w0}}  {r[1]:>22}  {r[2]:>22}", file=out)
    print(f"\n  speed-up {result['speedup']:.2f}x; max |loss diff| over {args.steps} steps "
          f"{max_diff:.2e} (tolerance {_demo.LOSS_TOL:g}); step-0 grad rel diff "
          f"{c0['grad_rel_diff']:.1e} (router {c0['grad_rel_diff_router']:.1e}, experts "
          f"{c0['grad_rel_diff_experts']:.1e}; tolerance {_demo.GRAD_TOL:g})", file=out)
    print(f"  same-state checks: " + ", ".join(
        f"step {c['step']} {c['status']} (loss diff {c['loss_diff']:.1e})" for c in checks)
        + f"; routings that differ between the two trained models: {mismatched:,}"
        + (f" (first at step {first_mismatch})" if first_mismatch is not None else ""),
        file=out)
    print(f"  result: {'PASS' if ok else 'FAIL'}", file=out)
    for r in reasons:
        print(f"    - {r}", file=out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"  wrote {args.json} (results as JSON)", file=out)
    if args.plot:
        _demo.write_plot(args.plot, loss_p, loss_b, f"{label_p} ({tps_p:,.0f} tokens/s)",
                         first_mismatch, label_b=f"{label_b} ({tps_b:,.0f} tokens/s)",
                         title=f"transformers {args.hf}: moegrad.hf vs {label_b}")
        print(f"  wrote {args.plot} (loss curves)", file=out)
    return 0 if ok else 1
