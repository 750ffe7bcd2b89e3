"""The training demo (python -m moegrad.demo): a tiny MoE language model on moegrad ops, trained
side by side with the same model in plain PyTorch.

* A short run on a small text file written here passes its own agreement check and writes every
  JSON field; `python -m moegrad.demo` works as a command and writes the plot.
* All three backward kernels are on the training path (counted while the demo trains).
* A deliberately broken moegrad path is caught (exit status 1): a 0.1% error in the routing
  scales of the forward, and a 0.1% error in the router gradient alone (the loss is then
  unchanged, only the gradient comparison can see it).
* The token permutation the demo builds is the column layout of moe_finalize_routing (D8), and
  the missing default data gives an install hint.
No timing is asserted.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import moegrad
import moegrad.nn.moe as moe_mod
from moegrad.ops import finalize_routing, gating_topk, swiglu
from moegrad import demo

REQUIRED_KEYS = ("steps", "loss_first", "loss_last", "max_abs_loss_diff", "grad_rel_diff_step0",
                 "tokens_per_s_moegrad", "tokens_per_s_reference")

# A small model so each run takes a second or two; the MoE layout is the demo's default
# (8 experts, 4 groups keep 2, top-2).
SMALL = ["--batch", "4", "--seq", "32", "--d-model", "32", "--d-expert", "32", "--quiet",
         "--sample", "0"]

WORDS = ("the of and to a in that is was he for it with as his on be at by had not are but from "
         "or have an they which one you were her all she there would their we him been has when "
         "who will more no if out so said what up its about into than them can only other new "
         "some could time these two may then do first any my now such like our over man me even "
         "most made after also did many before must through back years where much your way well "
         "down should because each just those people how too little state good very make world "
         "still own see men work long get here between both life being under never day same "
         "another know while last might us great old year off come since against go came right "
         "used take three").split()


@pytest.fixture
def text_file(tmp_path, seed):
    """About 20 kB of English-like text: random sentences from common words."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(400):
        n = int(rng.integers(4, 12))
        words = [WORDS[int(i)] for i in rng.integers(0, len(WORDS), n)]
        lines.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", ","]))
    p = tmp_path / "small.txt"
    p.write_text("\n".join(lines) + "\n")
    return p


def run_demo(tmp_path, text_file, seed, *extra):
    out = tmp_path / "demo.json"
    rc = demo.main(["--steps", "5", "--data", str(text_file), "--seed", str(seed),
                    "--json", str(out), *SMALL, *extra])
    return rc, json.loads(out.read_text())


def test_demo_short_run_passes_and_writes_all_fields(tmp_path, text_file, seed):
    threads_before = torch.get_num_threads()
    rc, doc = run_demo(tmp_path, text_file, seed, "--threads", "1")
    assert torch.get_num_threads() == threads_before, "the demo must restore torch's threads"
    for key in REQUIRED_KEYS:
        assert key in doc, key
    assert doc["steps"] == 5
    for key in REQUIRED_KEYS[1:]:
        assert isinstance(doc[key], float) and math.isfinite(doc[key]), (key, doc[key])
    assert doc["tokens_per_s_moegrad"] > 0 and doc["tokens_per_s_reference"] > 0
    # An untrained byte-level model predicts about uniformly over 256 bytes: ln 256 = 5.55.
    assert abs(doc["loss_first"] - math.log(256)) < 0.5, doc["loss_first"]
    assert doc["loss_first_reference"] == doc["loss_first"] or \
        abs(doc["loss_first_reference"] - doc["loss_first"]) <= demo.SAME_LOSS_TOL
    # The tolerance check passed, and its verdict agrees with the documented thresholds.
    assert rc == 0 and doc["passed"] is True, doc
    assert doc["max_abs_loss_diff"] <= demo.LOSS_TOL
    checks = doc["same_state_checks"]
    assert [c["step"] for c in checks] == [0, 4]          # step 0 and the last step
    assert any(c["status"] == "ok" for c in checks)
    for c in checks:
        assert c["status"] in ("ok", "tie"), c
        if c["status"] == "ok":
            assert c["loss_diff"] <= demo.SAME_LOSS_TOL and c["grad_rel_diff"] <= demo.GRAD_TOL
    if checks[0]["status"] == "ok":
        assert doc["grad_rel_diff_step0"] <= demo.GRAD_TOL
        # The moegrad gradients are not bit-identical copies of the reference's: they come
        # from moegrad's own backward kernels (different rounding), yet agree to fp32 level.
        assert doc["grad_rel_diff_step0_router"] <= demo.GRAD_TOL
        assert doc["grad_rel_diff_step0_experts"] <= demo.GRAD_TOL


def test_demo_as_a_command_writes_json_and_plot(tmp_path, text_file, seed):
    out_json, out_png = tmp_path / "d.json", tmp_path / "d.png"
    env = dict(os.environ)
    proc = subprocess.run(
        [sys.executable, "-m", "moegrad.demo", "--steps", "3", "--data", str(text_file),
         "--seed", str(seed), "--json", str(out_json), "--plot", str(out_png), *SMALL],
        capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout
    doc = json.loads(out_json.read_text())
    assert set(REQUIRED_KEYS) <= set(doc) and doc["steps"] == 3 and doc["passed"] is True
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _counting(monkeypatch, name, counts, transform=None):
    """Replace <name> in its family module (what the autograd formulas call) by a counting
    wrapper; the SwiGLU backward also where the layer calls it on the CPU to write its gradient
    over its input (L228)."""
    targets = {"moe_gating_top_k_backward": [(gating_topk, name)],
               "moe_finalize_routing_grad": [(finalize_routing, name)],
               "swiglu_group_quant_backward": [(swiglu, name),
                                               (moe_mod, "_swiglu_group_backward_over_x")]}[name]
    for module, attr in targets:
        orig = getattr(module, attr)

        def wrapper(*args, _orig=orig, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            out = _orig(*args, **kwargs)
            return transform(out) if transform is not None else out

        monkeypatch.setattr(module, attr, wrapper)


def test_demo_training_path_runs_all_three_backward_kernels(tmp_path, text_file, seed,
                                                            monkeypatch):
    counts = {}
    for name in ("moe_gating_top_k_backward", "moe_finalize_routing_grad",
                 "swiglu_group_quant_backward"):
        _counting(monkeypatch, name, counts)
    rc, doc = run_demo(tmp_path, text_file, seed)
    assert rc == 0, doc
    layers = 2                                          # demo default --layers
    # One backward of the moegrad model per step and layer (the reference and the
    # same-state copies are plain PyTorch and never call moegrad).
    assert counts == {"moe_gating_top_k_backward": 5 * layers,
                      "moe_finalize_routing_grad": 5 * layers,
                      "swiglu_group_quant_backward": 5 * layers}, counts


def test_demo_catches_perturbed_routing_scales(tmp_path, text_file, seed, monkeypatch):
    """A 0.1 % error in the scales fed to moe_finalize_routing must fail the run."""
    orig = moegrad.moe_finalize_routing
    calls = []

    def broken(expanded_x, expanded_row_idx, *args, scales=None, **kwargs):
        calls.append(1)
        return orig(expanded_x, expanded_row_idx, *args, scales=scales * 1.001, **kwargs)

    monkeypatch.setattr(moegrad, "moe_finalize_routing", broken)
    rc, doc = run_demo(tmp_path, text_file, seed)
    assert calls, "the demo did not call moegrad.moe_finalize_routing"
    assert rc == 1 and doc["passed"] is False
    assert doc["grad_rel_diff_step0"] > demo.GRAD_TOL
    # The perturbed model can flip a few routings in the second layer; such a check counts as
    # a tie and is not compared. The run must then still fail, because nothing was compared.
    statuses = [c["status"] for c in doc["same_state_checks"]]
    assert "FAIL" in statuses or all(s == "tie" for s in statuses), statuses


def test_demo_catches_wrong_router_gradient(tmp_path, text_file, seed, monkeypatch):
    """A 0.1 % error in the gating backward alone leaves the loss untouched; the gradient
    comparison must still fail the run."""
    counts = {}
    _counting(monkeypatch, "moe_gating_top_k_backward", counts, transform=lambda g: g * 1.001)
    rc, doc = run_demo(tmp_path, text_file, seed)
    assert counts.get("moe_gating_top_k_backward", 0) > 0
    assert rc == 1 and doc["passed"] is False
    assert doc["same_state_checks"][0]["loss_diff"] <= demo.SAME_LOSS_TOL   # loss unchanged
    assert doc["grad_rel_diff_step0_router"] > demo.GRAD_TOL


def test_route_permutation_is_the_finalize_column_layout(seed):
    """row_idx[k*R + r] is the sorted position of (token r, slot k); positions are grouped by
    expert in ascending order, stable in the column-flat index."""
    g = torch.Generator().manual_seed(seed)
    R, K, E = 37, 3, 8
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(R)]).to(torch.int32)
    order, row_idx, counts, tok = demo.route_permutation(idx, E)
    assert sorted(row_idx.tolist()) == list(range(R * K))
    assert counts.tolist() == [int((idx == e).sum()) for e in range(E)]
    expert_of_pos = [None] * (R * K)
    for r in range(R):
        for k in range(K):
            p = int(row_idx[k * R + r])
            assert int(tok[p]) == r and int(order[p]) == k * R + r
            expert_of_pos[p] = int(idx[r, k])
    assert expert_of_pos == sorted(expert_of_pos)
    # within one expert, positions follow the column-flat index k*R + r (stable sort)
    for e in range(E):
        flats = [int(order[p]) for p in range(R * K) if expert_of_pos[p] == e]
        assert flats == sorted(flats)
    # and moegrad's finalize combines with that layout: compare with a float64 sum
    H = 5
    ex = torch.randn(R * K, H, generator=g)
    y = torch.rand(R, K, generator=g)
    out = moegrad.moe_finalize_routing(ex, row_idx, scales=y, drop_pad_mode=0, k=K)
    want = np.zeros((R, H))
    for r in range(R):
        for k in range(K):
            want[r] += float(y[r, k]) * ex[int(row_idx[k * R + r])].double().numpy()
    np.testing.assert_allclose(out.double().numpy(), want, rtol=1e-5, atol=1e-6)


def test_missing_default_data_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(demo, "FORTUNES_DIR", str(tmp_path / "no-such-dir"))
    with pytest.raises(SystemExit) as e:
        demo.load_text(None)
    assert "apt-get install fortunes" in str(e.value) and "--data" in str(e.value)


def test_calibration_run_measures_without_judging(tmp_path, text_file, seed):
    """--calibrate trains two plain-PyTorch models whose initial weights differ by one ulp."""
    rc, doc = run_demo(tmp_path, text_file, seed, "--calibrate")
    assert rc == 0 and doc["calibration_run"] is True and doc["failures"] == []
    assert set(REQUIRED_KEYS) <= set(doc)
    # the nudge is real (gradients differ at step 0) and tiny (fp32 rounding level)
    assert 0 < doc["grad_rel_diff_step0"] < 1e-4


# ---- A user's first hour (docs/decisions.md L62): output labels, files, printable sample, and
# ---- optional dependencies checked before any work.

def test_demo_plot_without_matplotlib_fails_before_training(tmp_path, text_file, monkeypatch,
                                                            capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)        # import matplotlib -> ImportError
    monkeypatch.setattr(demo, "_run", lambda *a: pytest.fail("trained before checking --plot"))
    rc = demo.main(["--steps", "5", "--data", str(text_file), "--plot", str(tmp_path / "p.png")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "matplotlib" in err and "moegrad[demo]" in err and ".[demo]" in err, err
    assert not (tmp_path / "p.png").exists()


def test_demo_missing_output_folder_fails_before_training(tmp_path, text_file, monkeypatch,
                                                          capsys):
    monkeypatch.setattr(demo, "_run", lambda *a: pytest.fail("trained before checking --json"))
    rc = demo.main(["--data", str(text_file), "--json", str(tmp_path / "no" / "d.json")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err


def test_demo_labels_progress_and_names_written_files(tmp_path, text_file, seed, capsys):
    out_json = tmp_path / "d.json"
    small = [a for a in SMALL if a != "--quiet"]
    rc = demo.main(["--steps", "2", "--data", str(text_file), "--seed", str(seed),
                    "--json", str(out_json), *small])
    captured = capsys.readouterr()
    assert rc == 0
    progress = [line for line in captured.err.splitlines() if "2/2" in line]
    assert progress and "moegrad" in progress[-1] and "PyTorch" in progress[-1], captured.err
    assert f"wrote {out_json}" in captured.out


def test_demo_sample_text_is_printable():
    cut = "naïve café — ok".encode()[:-4]                          # ends inside the dash
    text = demo.printable(cut + b"\x00\x1b[2J\xff\xfe" + "ünïcode\nline\ttab".encode())
    assert "\ufffd" not in text
    assert all(c.isprintable() or c in "\n\t" for c in text)
    assert text.startswith("naïve café ") and text.endswith("ünïcode\nline\ttab")
    assert demo.printable(b"The \xe2\x80") == "The "             # a cut 3-byte sequence
