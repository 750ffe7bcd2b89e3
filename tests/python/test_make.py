"""The make targets the README names work as written (docs/decisions.md L175).

* `make demo-ep` runs the expert-parallel demo through the environment's own torchrun, so it works
  right after the set-up commands, without an activated .venv; a tiny run of it trains.
* The build says what it does and how long it takes, and shows the compiler's progress instead of
  a silent `pip install -q`.
* Commands in README.md and docs/ that start torchrun name the one in .venv.
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
VENV_PY = ROOT / ".venv" / "bin" / "python"

pytestmark = pytest.mark.skipif(shutil.which("make") is None or not VENV_PY.exists(),
                                reason="needs make and the checkout's .venv (make setup)")

# A small model on a text file written here: the run takes seconds.
SMALL = "--steps 2 --batch 4 --seq 16 --d-model 16 --d-expert 16 --sample 0 --quiet"


def _make(*args, timeout=60):
    # -o: take the installed moegrad as it is; these tests must not start a rebuild.
    return subprocess.run(["make", "-C", str(ROOT), "--no-print-directory",
                           "-o", ".venv/.installed", "-o", ".venv/.deps", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_demo_ep_target_runs_torchrun_of_the_venv():
    dry = _make("-n", "demo-ep")
    assert dry.returncode == 0, dry.stderr
    command = dry.stdout.strip().splitlines()[-1]
    assert command.startswith(".venv/bin/python -m torch.distributed.run --standalone "
                              "--nproc-per-node 2 -m moegrad.demo --ep 2"), command


def test_demo_ep_target_trains(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"word{i % 97} and more text" for i in range(4000)))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(["make", "-C", str(ROOT), "--no-print-directory", "-o", ".venv/.installed",
                        "-o", ".venv/.deps", "demo-ep",
                        f"ARGS={SMALL} --data {text} --json {tmp_path / 'ep.json'}"],
                       capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "expert-parallel run: 2 ranks x 4 experts" in p.stdout, p.stdout
    assert (tmp_path / "ep.json").exists()


def test_build_says_what_it_does_and_shows_progress():
    dry = subprocess.run(["make", "-C", str(ROOT), "--no-print-directory", "-n", "-B",
                          ".venv/.installed", "build/cpp/.built"],
                         capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    out = re.sub(r"\\\n\s*", " ", dry.stdout)  # one line per command (continuations joined)
    install = [line for line in out.splitlines() if "pip install" in line and line.endswith(" .")]
    assert install, out
    assert " -v " in install[0] and " -q " not in install[0], install[0]
    messages = re.findall(r"^echo \"==> (.*?)$", out, re.M)
    assert any("Compiling moegrad" in m for m in messages), out
    assert re.search(r"about \d(-\d)? minutes", out), out
    assert "Building the C++ library" in out, out


def test_torchrun_commands_in_the_docs_name_the_venv():
    bad = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text(encoding="utf-8")
        for m in re.finditer(r"(\S*)torchrun\s+--standalone", text):
            if not m.group(1).endswith(".venv/bin/"):
                number = text.count("\n", 0, m.start()) + 1
                bad.append(f"{doc.relative_to(ROOT)}:{number}: {m.group(0)}")
    assert not bad, "torchrun outside .venv (not on PATH after the set-up):\n" + "\n".join(bad)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "make demo-ep" in readme
