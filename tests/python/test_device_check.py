"""scripts/device_check.sh (docs/cuda.md "The device check"): its --dry-run runs here without a
GPU: every step in order with its limit, the limits within the 7-minute budget, the committed
Highway packages unpacked, the table printed; a budget too small for a step skips it."""
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "device_check.sh")
STEPS = ["build", "tests", "memcheck", "sync", "bench"]


def run(tmp_path, *args, **env):
    e = dict(os.environ, OUT=str(tmp_path / "out"), **env)
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, env=e,
                          timeout=120, cwd=ROOT)


def test_dry_run_walks_every_step_within_the_budget(tmp_path):
    r = run(tmp_path, "--dry-run")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    limits = dict(re.findall(r"^=== (\w+) \(limit (\d+)s\)", r.stdout, re.M))
    assert list(limits) == STEPS
    assert sum(int(v) for v in limits.values()) < 420
    total = re.search(r"step limits: (\d+) s in all, budget (\d+) s", r.stdout)
    assert total and int(total.group(1)) <= int(total.group(2)) <= 420
    table = r.stdout[r.stdout.index("==================== device check"):]
    for s in STEPS:
        assert re.search(rf"^{s}\s+ok\s", table, re.M), table
    # the commands the steps would run
    assert "--no-compile" in r.stdout and "bench_cuda.json" in r.stdout
    assert "device_calls.py memcheck" in r.stdout and "device_calls.py sync" in r.stdout
    assert "MOEGRAD_WITH_CUDA=ON" in r.stdout
    for s in STEPS:
        assert (tmp_path / "out" / f"{s}.log").exists()


def test_dry_run_unpacks_the_committed_highway_packages(tmp_path):
    debs = [f for f in os.listdir(os.path.join(ROOT, "scripts", "device-deps"))
            if f.endswith(".deb")]
    assert any(f.startswith("libhwy-dev_") for f in debs) and any(
        f.startswith("libhwy1_") for f in debs)
    r = run(tmp_path, "--dry-run")
    assert r.returncode == 0
    assert "unpacked 2 packages" in r.stdout
    assert os.path.isfile(os.path.join(ROOT, "build", "device-deps", "prefix", "usr", "include",
                                       "hwy", "highway.h"))


def test_a_spent_budget_skips_steps_and_fails(tmp_path):
    # Each dry step counts as 100 s: the fifth finds less than 10 s left and is skipped.
    r = run(tmp_path, "--dry-run", DEVICE_CHECK_DRY_STEP_S="100")
    assert r.returncode == 1, r.stdout[-2000:]
    assert re.search(r"^bench\s+SKIPPED\s.*time budget spent", r.stdout, re.M), r.stdout[-2000:]
    assert re.search(r"^build\s+ok\s", r.stdout, re.M)


def test_limits_over_the_budget_are_refused(tmp_path):
    r = run(tmp_path, "--dry-run", BUDGET_S="100")
    assert r.returncode == 2 and "exceed the budget" in r.stderr


@pytest.mark.parametrize("arg", ["--bogus"])
def test_unknown_argument(tmp_path, arg):
    r = run(tmp_path, arg)
    assert r.returncode == 2 and "usage" in r.stderr
