"""Every relative link in README.md, benchmarks/README.md, docs/ and docs/notes/ points at a file that exists, and
every #anchor at a heading of that file (GitHub's slugs)."""
from __future__ import annotations

import glob
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from doc_blocks import ROOT  # noqa: E402

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
PAGES = sorted({os.path.relpath(p, ROOT) for p in
                [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "benchmarks", "README.md")]
                + glob.glob(os.path.join(ROOT, "docs", "*.md"))
                + glob.glob(os.path.join(ROOT, "docs", "notes", "*.md"))})


def prose_lines(path: str):
    """(line number, text) of the lines outside fenced code blocks."""
    fenced = False
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            if not fenced:
                yield n, line


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (not - or _), blanks to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: str) -> set:
    seen: dict = {}
    out = set()
    for _, line in prose_lines(path):
        m = HEADING.match(line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_slug_follows_github():
    assert slug("4. Online re-balancing in the engine") == "4-online-re-balancing-in-the-engine"
    assert slug("Prompt steps: the last layer") == "prompt-steps-the-last-layer"
    assert slug("The `serve` group (`moe_infer/conf/serve/`)") == "the-serve-group-moe_inferconfserve"
    assert slug("Metrics (`GET /metrics`, prefix `moe_infer:`)") == "metrics-get-metrics-prefix-moe_infer"


@pytest.mark.parametrize("page", PAGES)
def test_links_resolve(page):
    path = os.path.join(ROOT, page)
    broken = []
    for n, line in prose_lines(path):
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
            if not os.path.exists(dest):
                broken.append(f"{page}:{n}: {target} (no such file)")
            elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                broken.append(f"{page}:{n}: {target} (no heading with that anchor)")
    assert not broken, "\n".join(broken)
