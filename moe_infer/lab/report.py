"""The report page: a Markdown file beside the results that shows their tables and figures.

Each task writes its section (`Section`); `write_report` puts them in one `report.md` with relative
links to the PNGs, so the folder can be committed or browsed as it is. `gather` re-reads the
sections other task runs left (`section.json`) to build one page over several result folders.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence


@dataclass
class Section:
    title: str
    text: str = ""
    table: List[Dict[str, Any]] = field(default_factory=list)
    columns: List[str] = field(default_factory=list)  # shown columns (default: all of the first row)
    images: List[str] = field(default_factory=list)  # paths relative to the section's folder
    folder: str = "."  # the section's result folder, relative to the report


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, dict)):
        return json.dumps(v)[:60]
    return "" if v is None else str(v)


def markdown_table(rows: Sequence[Dict[str, Any]], columns: Optional[Sequence[str]] = None) -> str:
    if not rows:
        return "(no rows)\n"
    cols = list(columns or rows[0].keys())
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def save_section(section: Section, folder: str) -> None:
    with open(os.path.join(folder, "section.json"), "w") as f:
        json.dump(asdict(section), f, indent=1, default=str)


def write_report(out_dir: str, title: str, sections: Sequence[Section], intro: str = "") -> str:
    parts = [f"# {title}\n", intro + "\n" if intro else ""]
    for s in sections:
        parts.append(f"## {s.title}\n")
        if s.text:
            parts.append(s.text.strip() + "\n")
        for img in s.images:
            rel = os.path.normpath(os.path.join(s.folder, img))
            parts.append(f"![{os.path.basename(img)}]({rel})\n")
        if s.table:
            parts.append(markdown_table(s.table, s.columns or None))
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(p for p in parts if p))
    return path


def gather(out_dir: str, folders: Sequence[str], title: str = "Load-balance lab report") -> str:
    """One report over the `section.json` files of `folders` (paths relative to out_dir or absolute)."""
    sections = []
    for folder in folders:
        path = os.path.join(out_dir, folder, "section.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no section.json (was the task run with this output folder?)")
        with open(path) as f:
            s = Section(**json.load(f))
        s.folder = os.path.relpath(os.path.join(out_dir, folder), out_dir)
        sections.append(s)
    return write_report(out_dir, title, sections)
