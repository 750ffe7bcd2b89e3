"""Every code block of README.md and docs/*.md that is marked runnable runs as written.

The convention (docs/decisions.md L174): the line before a fenced ``python`` or
``bash`` block is one of

    <!-- runnable -->                               run as written
    <!-- runnable; test with 'A' => 'B', ... -->    run with each A replaced by B (smaller sizes, a
                                                    faster compile backend); every A must occur
    <!-- signature -->                              a signature sketch, not code
    <!-- not run: reason -->                        installs, builds or trains for minutes

Python blocks run as a script (``python block.py``) in an empty folder; bash blocks run with
``bash -e`` in an empty folder holding a link ``.venv`` to the checkout's virtual environment, so
``.venv/bin/python ...`` works as after the README's set-up commands and the files a block
writes land in the folder. Each block must exit with status 0.
"""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv"
LANGUAGES = ("python", "bash", "sh")
MARKER = re.compile(r"^<!--\s*(runnable|signature|not run)\b(.*?)-->\s*$")
REPLACEMENT = re.compile(r"'([^']*)'\s*=>\s*'([^']*)'")
# Reference pages whose signature and benchmark blocks carry no marker yet.
UNMARKED: set = set()


def _documents():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(path):
    """(line, language, marker kind, marker rest, code) of every fenced block of `path`."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start = i
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(before.strip())
        kind, rest = (marker.group(1), marker.group(2)) if marker else (None, "")
        out.append((start + 1, m.group(1), kind, rest, "\n".join(lines[start + 1:end]) + "\n"))
        i = end + 1
    return out


def _runnable():
    cases = []
    for doc in _documents():
        for line, lang, kind, rest, code in _blocks(doc):
            if kind == "runnable" and lang in LANGUAGES:
                name = f"{doc.relative_to(ROOT)}:{line}"
                cases.append(pytest.param(doc, line, lang, rest, code, id=name))
    return cases


def _apply_replacements(rest, code, where):
    pairs = REPLACEMENT.findall(rest)
    if rest.strip() and not pairs:
        raise AssertionError(f"{where}: unreadable marker {rest!r}; expected "
                             "\"; test with 'A' => 'B'\"")
    for old, new in pairs:
        assert old in code, f"{where}: the marker replaces {old!r}, which the block lacks"
        code = code.replace(old, new)
    return code


def _own_entry_point(code):
    """A virtual environment copied from another checkout keeps that checkout's interpreter in
    its entry-point scripts; run torchrun through this environment's python instead."""
    script = VENV / "bin" / "torchrun"
    if ".venv/bin/torchrun" in code and script.is_file():
        first = script.read_text(errors="replace").splitlines()[0]
        if pathlib.Path(first[2:].strip()) != VENV / "bin" / "python":
            code = code.replace(".venv/bin/torchrun",
                                ".venv/bin/python -m torch.distributed.run")
    return code


def test_every_python_and_bash_block_is_marked():
    bad = []
    for doc in _documents():
        name = str(doc.relative_to(ROOT))
        if name in UNMARKED:
            continue
        for line, lang, kind, _, _ in _blocks(doc):
            if lang in LANGUAGES and kind is None:
                bad.append(f"{name}:{line}: ```{lang} without <!-- runnable -->, "
                           "<!-- signature --> or <!-- not run: reason -->")
    assert not bad, "unmarked code blocks:\n" + "\n".join(bad)


def test_the_readme_and_layer_guide_have_runnable_blocks():
    """The examples a new user pastes first are among the blocks run below."""
    ran = {p.values[0].name for p in _runnable()}
    assert {"README.md", "layer.md", "demo.md"} <= ran, ran


def test_the_block_parser_works(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("text\n<!-- runnable; test with 'n = 9' => 'n = 1' -->\n```python\nn = 9\n"
                   "```\n\n<!-- signature -->\n```python\nf(x) -> y\n```\n```bash\nls\n```\n")
    blocks = _blocks(doc)
    assert [(b[1], b[2]) for b in blocks] == [("python", "runnable"), ("python", "signature"),
                                             ("bash", None)]
    assert _apply_replacements(blocks[0][3], blocks[0][4], "x") == "n = 1\n"
    with pytest.raises(AssertionError, match="lacks"):
        _apply_replacements(" test with 'm = 2' => 'm = 1'", "n = 9\n", "x")


@pytest.mark.parametrize("doc,line,lang,rest,code", _runnable())
def test_runnable_block_runs(tmp_path, doc, line, lang, rest, code):
    where = f"{doc.relative_to(ROOT)}:{line}"
    code = _apply_replacements(rest, code, where)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"),
               PYTHONUNBUFFERED="1")
    if lang == "python":
        (tmp_path / "block.py").write_text(code, encoding="utf-8")
        cmd = [sys.executable, "block.py"]
    else:
        if ".venv/" in code:
            if not (VENV / "bin" / "python").exists():
                pytest.skip("no .venv in this checkout (moegrad installed another way)")
            (tmp_path / ".venv").symlink_to(VENV, target_is_directory=True)
            code = _own_entry_point(code)
        cmd = ["bash", "-e", "-c", code]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (f"{where} ({lang}) exited with {p.returncode}\n--- stdout\n"
                               f"{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-3000:]}")


def test_the_code_cites_only_documents_of_the_repository():
    """Docstrings and comments of the library and its examples cite README.md or a page of
    docs/ (often without the docs/ prefix); never a contract file users do not have (api.md)."""
    pages = {"README.md", *(p.name for p in (ROOT / "docs").glob("*.md"))}
    bad = []
    for base in ("python", "include", "src", "examples"):
        for path in sorted((ROOT / base).rglob("*")):
            if not path.is_file() or path.suffix not in (".py", ".h", ".cc", ".cu", ".cuh",
                                                         ".c", ".cpp", ".txt"):
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            for number, line in enumerate(text.splitlines(), 1):
                for m in re.finditer(r"(?<![\w.-])(?<!--markdown )([\w-]+\.md)\b", line):
                    if m.group(1) not in pages:
                        bad.append(f"{path.relative_to(ROOT)}:{number}: {m.group(1)}")
    assert not bad, "citations of documents the repository does not have:\n" + "\n".join(bad)
