"""Result tables: one CSV and one JSON per table, and the rows of a Hydra multirun's jobs."""
from __future__ import annotations

import csv
import dataclasses
import glob
import json
import os
from typing import Any, Dict, List

import numpy as np


def _jsonable(obj):
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def write_json(path: str, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=_jsonable)


def write_table(rows: List[Dict[str, Any]], out_dir: str, name: str) -> Dict[str, str]:
    """`name.json` (the rows) and `name.csv` (flat columns: lists and dicts as JSON text, the union of
    the rows' keys in first-seen order) under out_dir; returns both paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, f"{name}.json"), "csv": os.path.join(out_dir, f"{name}.csv")}
    write_json(paths["json"], rows)
    cols: List[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow({k: json.dumps(v, default=_jsonable) if isinstance(v, (list, dict)) else
                        (v.item() if isinstance(v, np.generic) else v) for k, v in r.items()})
    return paths


def collect_rows(sweep_dir: str, filename: str = "result.json") -> List[Dict[str, Any]]:
    """The row every job of a multirun left in its folder (`<sweep_dir>/<job>/<filename>`), by job number."""
    def job_num(path: str):
        name = os.path.basename(os.path.dirname(path))
        return (0, int(name)) if name.isdigit() else (1, name)

    rows = []
    for path in sorted(glob.glob(os.path.join(sweep_dir, "*", filename)), key=job_num):
        with open(path) as f:
            rows.append(json.load(f))
    return rows
