"""The fenced code blocks of the user docs (README.md, docs/*.md) and the commands in them, for the doc tests.

A ```bash (or sh, shell, console) block holds commands, one a line; a line ending in a backslash goes on, and a
`#` outside quotes starts a comment. A ```python block is a snippet; the snippets of one doc run in order in one
interpreter, as a reader typing them in would. Other blocks (json, yaml, plain output) are not run.
"""
from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from typing import Iterator, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHELL_LANGS = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^(\s*)```\s*([\w+-]*)")


@dataclass(frozen=True)
class Block:
    doc: str      # path relative to the repo root
    line: int     # 1-based line of the first line of the block's text
    lang: str
    text: str


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    text: str

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def user_docs() -> List[str]:
    """README.md and the guides in docs/ (not docs/notes/: measurement notes, not instructions)."""
    return ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))


def blocks(doc: str) -> Iterator[Block]:
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        lines = f.read().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = len(m.group(1)), m.group(2).lower()
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith("```"):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        if j == len(lines):
            raise ValueError(f"{doc}:{i + 1}: a fenced block that never closes")
        yield Block(doc, i + 2, lang, "\n".join(body))
        i = j + 1


def strip_comment(line: str) -> str:
    """The line without a shell comment: a `#` at the start or after a blank, outside quotes."""
    quote = None
    for k, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or line[k - 1] in " \t"):
            return line[:k]
    return line


def shell_commands(block: Block) -> Iterator[Command]:
    pending, start = "", block.line
    for n, raw in enumerate(block.text.splitlines()):
        if not pending:
            start = block.line + n
        line = strip_comment(raw).rstrip()
        if raw.rstrip().endswith("\\") and line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = (pending + line).strip()
        pending = ""
        if text.startswith("$ "):
            text = text[2:]
        if text:
            yield Command(block.doc, start, text)


def all_commands() -> List[Command]:
    return [c for doc in user_docs() for b in blocks(doc) if b.lang in SHELL_LANGS for c in shell_commands(b)]


def python_blocks(doc: str) -> List[Block]:
    return [b for b in blocks(doc) if b.lang in ("python", "py")]
