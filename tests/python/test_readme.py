"""The README's PyTorch example runs as printed and shows what it claims (docs/decisions.md L61):
the router gets a non-zero gradient, autograd agrees with a finite difference, and training the
router alone lowers the loss. Also: the README starts with the two set-up-free commands."""
from __future__ import annotations

import pathlib
import re

import torch

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def _text():
    return README.read_text(encoding="utf-8")


def test_readme_starts_with_make_demo_and_make_test():
    first_block = re.search(r"```bash\n(.*?)```", _text(), re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines() if line.strip()]
    assert commands[:2] == ["make demo", "make test"]


def test_readme_example_router_learns(capsys):
    m = re.search(r"## Using it from PyTorch.*?```python\n(.*?)```", _text(), re.S)
    assert m, "README.md lost its '## Using it from PyTorch' python block"
    ns: dict = {}
    exec(compile(m.group(1), str(README), "exec"), ns)
    out = capsys.readouterr().out
    printed = re.search(r"slope: autograd ([-\d.e]+), finite difference ([-\d.e]+)", out)
    assert printed, out
    slope, fd = float(printed.group(1)), float(printed.group(2))
    assert slope > 1e-3, f"the router gradient vanished (shared expert weights?): {out}"
    assert abs(slope - fd) <= 1e-2 * slope, out
    assert ns["after"].item() < 0.95 * ns["before"].item(), out
    # The residual gets its gradient (D23): at least the residual path's d loss / d out.
    x, router, target = ns["x"], ns["router"], ns["target"]
    assert x.grad is not None and float(x.grad.norm()) > 0, out
    with torch.no_grad():
        dout = 2 * (ns["moe"](x, router) - target) / target.numel()
    # x.grad - dout is the experts' path, which the router's top-k weights make non-zero.
    assert float((x.grad - dout).norm()) > 0, out
