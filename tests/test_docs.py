"""Every relative link in the repository's Markdown resolves: the file exists, and an
``#anchor`` names a heading (or an ``<a id>``/``<a name>``) of the file it points into,
under GitHub's anchor rules. External links (http, https, mailto) are not fetched."""
from __future__ import annotations

import os
import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Not the repository's own pages: tools' and DVC's folders (its cache included), run stores,
# and pipeline outputs (data/ holds the stages' outputs, the exports' model cards included).
SKIP_DIRS = {".git", ".venv", "venv", ".dvc", "mlruns", "mlartifacts", "node_modules",
             ".pytest_cache", ".ruff_cache", "__pycache__", "build", "dist"}
SKIP_TOP = {"data", "export"}

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target): the text may hold one level of brackets
# ([`x`][y] is not matched); the target may be <in angle brackets> and carry a "title".
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]*)(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
SETEXT = re.compile(r"^ {0,3}(=+|-+)\s*$")
HTML_ID = re.compile(r"<a\s[^>]*?\b(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
TAG = re.compile(r"<[^>]+>")
MD_LINK_TEXT = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading's text (before duplicates are numbered): its
    rendered text, lowercased, every character that is not a letter, a digit, a mark, ``-``,
    ``_`` or a space dropped, each space turned into ``-``."""
    parts = re.split(r"(`+[^`]+`+)", heading)        # code spans render as their text
    text = "".join(part.strip("`") if i % 2 else
                   re.sub(r"\*+|(?<!\w)_+|_+(?!\w)", "",      # emphasis marks
                          TAG.sub("", MD_LINK_TEXT.sub(r"\1", part)))  # a link as its text, no HTML
                   for i, part in enumerate(parts))
    out = []
    for ch in text.lower():
        cat = unicodedata.category(ch)
        if ch in "-_" or ch == " " or cat[0] in "LM" or cat in ("Nd", "Nl"):
            out.append("-" if ch == " " else ch)
    return "".join(out)


def markdown_files(root: Path = ROOT) -> list[Path]:
    found = []
    for folder, dirs, files in os.walk(root):
        rel = Path(folder).relative_to(root).as_posix()
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS
                         and (f"{rel}/{d}" if rel != "." else d) not in SKIP_TOP
                         and not d.endswith(".egg-info"))
        found += [Path(folder) / f for f in sorted(files) if f.lower().endswith(".md")]
    return found


def prose_lines(text: str):
    """(line number, line, the line with its code spans blanked out) outside fenced code."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        opened = FENCE.match(line)
        if fence is not None:
            if opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence) \
                    and not line.strip()[len(opened.group(1)):].strip():
                fence = None
            continue
        if opened:
            fence = opened.group(1)
            continue
        yield number, line, CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)


def anchors(path: Path, _cache: dict[Path, set[str]] = {}) -> set[str]:  # noqa: B006
    """Every anchor GitHub gives the file: its headings' slugs, duplicates numbered -1,
    -2, ... in order, and the ids and names of its <a> tags."""
    if path not in _cache:
        seen: dict[str, int] = {}
        found: set[str] = set()
        previous = ""
        for _, line, blanked in prose_lines(path.read_text(encoding="utf-8")):
            found.update(HTML_ID.findall(blanked))
            heading = HEADING.match(line)
            setext = (SETEXT.match(line) if previous.strip() and not HEADING.match(previous)
                      else None)
            title = heading.group(2) if heading else previous.strip() if setext else None
            if setext and setext.group(1)[0] == "-" and previous.lstrip().startswith(("-", "|")):
                title = None                           # under a list item or a table: a rule
            if title is not None:
                slug = github_slug(title)
                count = seen.get(slug, 0)
                seen[slug] = count + 1
                found.add(slug if count == 0 else f"{slug}-{count}")
            previous = line
        _cache[path] = found
    return _cache[path]


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line: target (why)`` for each relative link of ``path`` that does not resolve."""
    problems = []
    for number, _, line in prose_lines(path.read_text(encoding="utf-8")):
        for match in LINK.finditer(line):
            target = match.group(1).strip("<>")
            if not target or SCHEME.match(target):
                continue                                       # http(s), mailto and the like
            where = f"{path.relative_to(root).as_posix()}:{number}: {target}"
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / unquote(file_part)).resolve() if file_part else path
            if not dest.exists():
                problems.append(f"{where} (no such file)")
                continue
            if not anchor:
                continue
            if dest.is_dir():
                dest = dest / "README.md"
                if not dest.exists():
                    problems.append(f"{where} (a folder without README.md to hold #{anchor})")
                    continue
            if dest.suffix.lower() != ".md":
                continue                                       # e.g. a source file's #L10
            if unquote(anchor) not in anchors(dest):
                problems.append(f"{where} (no heading or <a id> '#{anchor}' in "
                                f"{dest.relative_to(root).as_posix()})")
    return problems


@pytest.mark.parametrize(("heading", "slug"), [
    ("Two commands", "two-commands"),
    ("What's new?", "whats-new"),
    ("A/B: step (fp32)", "ab-step-fp32"),
    ("`decode_batching.py`", "decode_batchingpy"),
    ("R-Drop: the `multi30k_rdrop` preset", "r-drop-the-multi30k_rdrop-preset"),
    ("Multi30k en→de, 2 × 6,250 tokens", "multi30k-ende-2--6250-tokens"),
    ("**Bold** and [a link](x.md) – 2026-12-04", "bold-and-a-link--2026-12-04"),
    ("Größe _und_ Maß", "größe-und-maß"),
])
def test_github_slug(heading, slug):
    assert github_slug(heading) == slug


def test_anchors_number_duplicates_and_read_html_ids(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Results\n\n## Results\n\n```\n# Results\n```\n\nSetext\n======\n\n"
                    "- item\n---\n\n## Results\n\n<a id=\"kept\"></a>\n", encoding="utf-8")
    assert anchors(page) == {"results", "results-1", "results-2", "setext", "kept"}


def test_code_is_not_read_for_links(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[ok](page.md#title)\n# Title\n`[no](missing.md)`\n```\n[no](missing.md)\n```\n"
                    "[bad](missing.md) [bad](page.md#nowhere) [web](https://example.com/x.md)\n",
                    encoding="utf-8")
    assert broken_links(page, root=tmp_path) == [
        "page.md:7: missing.md (no such file)",
        "page.md:7: page.md#nowhere (no heading or <a id> '#nowhere' in page.md)",
    ]


def test_the_walk_finds_the_documentation():
    files = markdown_files()
    names = {p.relative_to(ROOT).as_posix() for p in files}
    assert len(files) > 40, sorted(names)
    assert {"README.md", "CHANGELOG.md", "docs/training.md", "docs/results/README.md"} <= names
    assert not any(n.startswith((".venv/", ".git/", "data/")) for n in names)


def test_every_relative_link_resolves():
    problems = [problem for path in markdown_files() for problem in broken_links(path)]
    assert not problems, f"{len(problems)} broken link(s):\n" + "\n".join(problems)
