"""The repository is self-contained and its citations resolve (docs/decisions.md L60).

* No tracked file refers to a location outside the repository.
* Every section tag (a section sign followed by N or N.M) cited anywhere resolves to a heading of
  docs/operators.md, and every decision tag (Dn, Ln, and ranges such as D1-D3) to an entry of
  docs/decisions.md; each entry is defined exactly once.
* Relative links in README.md and docs/*.md point to files that exist.
* The docs state the current truth: no development-history words (L60), and the tables of
  docs/performance.md between its "generated" markers are what the benchmark renders from the
  committed docs/perf.json.

Other engineers add tags all the time; this test names the file and line of a tag that does not
resolve, so a typo or a forgotten docs entry fails here instead of confusing a user.
"""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
OPERATORS = ROOT / "docs" / "operators.md"
DECISIONS = ROOT / "docs" / "decisions.md"

# Built by concatenation so that this file does not match itself.
FORBIDDEN = [re.compile(r"(?<![\w-])" + name + "/") for name in ("shared", "spec")]
SECTION_SIGN = "\u00a7"
SECTION_TAG = re.compile(SECTION_SIGN + r"\s?(\d+)(?:\.(\d+))?")
# Dn / Ln, optionally a range "D1-D3", "L4-L6", "D25–D31" (hyphen or en dash).
DECISION_TAG = re.compile(
    r"(?<![\w.])([DL])(\d{1,3})(?:\s?[-\u2013]\s?(?:\1)?(\d{1,3}))?(?![\w])"
    r"(?!\s?(?:cache|norm|loss|regulari))")


def _tracked_files():
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (e.g. an sdist): nothing to scan")
    files = []
    for name in out.decode().split("\0"):
        if not name:
            continue
        path = ROOT / name
        if not path.is_file():
            continue  # deleted in the work tree, not yet committed
        if name.startswith("tests/fuzz/corpus/"):
            continue  # fuzzer inputs: arbitrary bytes, not text
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary (images)
        files.append((name, data.decode("utf-8", errors="replace")))
    return files


def _lines(files):
    for name, text in files:
        for number, line in enumerate(text.splitlines(), 1):
            yield name, number, line


def _section_headings():
    found = set()
    for line in OPERATORS.read_text(encoding="utf-8").splitlines():
        m = re.match(r"#{2,4}\s+(\d+)(?:\.(\d+))?\.?\s", line)
        if m:
            found.add(m.group(1) if m.group(2) is None else f"{m.group(1)}.{m.group(2)}")
    return found


def _decision_entries():
    entries = []
    for line in DECISIONS.read_text(encoding="utf-8").splitlines():
        m = re.match(r"(?:- \*\*|#{2,4}\s+)([DL]\d+)\s", line)
        if m:
            entries.append(m.group(1))
    return entries


def _expand(kind, first, last):
    lo = int(first)
    hi = int(last) if last else lo
    return [f"{kind}{n}" for n in range(lo, hi + 1)]


def test_no_reference_outside_the_repository():
    bad = [f"{name}:{number}: {line.strip()}" for name, number, line in _lines(_tracked_files())
           if any(p.search(line) for p in FORBIDDEN)]
    assert not bad, "references outside the repository:\n" + "\n".join(bad)


def test_operator_sections_exist():
    headings = _section_headings()
    for top in range(0, 9):
        assert str(top) in headings, f"docs/operators.md lacks the section {top}"


def test_every_section_tag_resolves():
    headings = _section_headings()
    bad = []
    for name, number, line in _lines(_tracked_files()):
        for m in SECTION_TAG.finditer(line):
            tag = m.group(1) if m.group(2) is None else f"{m.group(1)}.{m.group(2)}"
            if tag not in headings:
                bad.append(f"{name}:{number}: {SECTION_SIGN}{tag}")
    assert not bad, ("section tags without a heading in docs/operators.md:\n" + "\n".join(bad))


def test_decision_entries_are_unique_and_complete():
    entries = _decision_entries()
    duplicates = sorted({e for e in entries if entries.count(e) > 1})
    assert not duplicates, f"docs/decisions.md defines these entries twice: {duplicates}"
    missing = [f"D{n}" for n in range(1, 32) if f"D{n}" not in entries]
    assert not missing, f"docs/decisions.md lacks the contract decisions {missing}"


def test_every_decision_tag_resolves():
    entries = set(_decision_entries())
    bad = []
    for name, number, line in _lines(_tracked_files()):
        for m in DECISION_TAG.finditer(line):
            for tag in _expand(m.group(1), m.group(2), m.group(3)):
                if tag not in entries:
                    bad.append(f"{name}:{number}: {tag} (in {m.group(0)!r})")
    assert not bad, "decision tags without an entry in docs/decisions.md:\n" + "\n".join(bad)


def _anchors(doc):
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    found = set()
    for line in doc.read_text(encoding="utf-8").splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            found.add(slug)
    return found


def test_relative_links_in_docs_exist():
    bad = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in re.finditer(r"\]\(([^)\s]+)\)", doc.read_text(encoding="utf-8")):
            target, _, anchor = m.group(1).partition("#")
            if re.match(r"[a-z]+:", target):
                continue  # URL
            path = doc.parent / target if target else doc
            if not path.exists():
                bad.append(f"{doc.relative_to(ROOT)}: {m.group(1)}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                bad.append(f"{doc.relative_to(ROOT)}: {m.group(1)} (no such heading)")
    assert not bad, "broken relative links:\n" + "\n".join(bad)


# Development-history words a user has no use for (built by concatenation, see FORBIDDEN).
HISTORY = re.compile(r"(?i)\b(?:" + "|".join(["wa" + "ves?", "spr" + "ints?", "iss" + r"ue\s?#?\d+"])
                     + r")\b")


def test_docs_speak_of_no_development_history():
    bad = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            if HISTORY.search(line):
                bad.append(f"{doc.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not bad, "docs describe what the library does now, not its history:\n" + "\n".join(bad)


GENERATED = re.compile(
    r"<!-- generated: (python -m moegrad\.bench [^\n]*?) -->\n(.*?)<!-- end generated -->", re.S)


def test_performance_tables_are_the_generated_ones(tmp_path):
    """Regenerate with the command in the marker (`<file>` is any path) and paste the result."""
    doc = ROOT / "docs" / "performance.md"
    blocks = GENERATED.findall(doc.read_text(encoding="utf-8"))
    assert blocks, "docs/performance.md lost its generated tables"
    for command, body in blocks:
        out = tmp_path / "tables.md"
        argv = command.replace("<file>", str(out)).split()
        assert argv[:3] == ["python", "-m", "moegrad.bench"], command
        proc = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True,
                              text=True, timeout=300)
        if proc.returncode != 0 and "No module named" in proc.stderr:
            pytest.skip("moegrad is not importable here: " + proc.stderr.strip().splitlines()[-1])
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert body.strip() == out.read_text(encoding="utf-8").strip(), (
            f"docs/performance.md: the tables differ from `{command}`; regenerate and paste them")


def test_the_tag_patterns_work():
    """The scanners above must be able to fail."""
    assert [m.group(0) for m in DECISION_TAG.finditer("D1-D3, L4, D25\u2013D31, D2H, 1D, L2 cache")] \
        == ["D1-D3", "L4", "D25\u2013D31"]
    assert _expand("D", "1", "3") == ["D1", "D2", "D3"]
    assert SECTION_TAG.search(SECTION_SIGN + "5.5 step 0").groups() == ("5", "5")
    assert FORBIDDEN[0].search("see ../" + "shar" + "ed/x") and not FORBIDDEN[0].search("unshared")
    assert HISTORY.search("the fifth " + "wave") and HISTORY.search("see " + "issue 12")
    assert not HISTORY.search("a microwave") and not HISTORY.search("the issue rate")
