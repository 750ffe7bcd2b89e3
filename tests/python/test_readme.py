"""The README's PyTorch example runs as printed and shows what it claims (docs/decisions.md L61):
it composes the operators through moe_permute / moe_unpermute (L170), the router gets a non-zero
gradient, autograd agrees with a finite difference, and training the router alone lowers the
loss. Also: the README starts with the two set-up-free commands, its "More" section links every
page of docs/ with whom it is for, and docs/demo.md's speed figures name the machine and the
command that measured them."""
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
    # The example shows the safe composition (L170), not a permutation written by hand.
    assert "moegrad.moe_permute(" in m.group(1) and "moegrad.moe_unpermute(" in m.group(1)
    assert "argsort" not in m.group(1)
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


def _more_section():
    m = re.search(r"^## More\n(.*?)(?=^## |\Z)", _text(), re.S | re.M)
    assert m, "README.md lost its '## More' section"
    return m.group(1)


def test_readme_more_links_every_doc_with_its_audience():
    """A reading order: every page of docs/ is linked from "More", with whom it is for."""
    more = _more_section()
    docs = sorted(p.name for p in (README.parent / "docs").glob("*.md"))
    missing = [d for d in docs if f"](docs/{d})" not in more]
    assert not missing, f"README.md '## More' does not link {missing}"
    for d in docs:
        line = re.search(rf"\]\(docs/{re.escape(d)}\) — (.*)", more).group(1)
        assert line.startswith("for "), f"docs/{d}: say whom the page is for; got {line!r}"


def test_demo_speed_claims_name_the_machine_and_the_command():
    demo = (README.parent / "docs" / "demo.md").read_text(encoding="utf-8")
    for m in re.finditer(r"tokens/s", demo):
        section = demo[demo.rfind("\n## ", 0, m.start()):]
        section = section[:section.find("\n## ", 1)]
        if re.search(r"\d[\d,]* tokens/s", section):
            assert re.search(r"AMD EPYC|Intel|vCPU", section), section[:400]
            assert re.search(r"`[^`]*\.venv/bin/python -m moegrad\.demo[^`]*`", section), \
                section[:400]
