"""Held-out text for the lab's experiments, as fixed windows of token ids.

`stdlib_validation` is the tiny model's validation split, re-collected from the running
interpreter's standard library with the rule of `scripts/train_tiny_moe.py`: a `.py` file (outside
site-/dist-packages, at most 400 kB, UTF-8) is held out when sha1(relative path) mod 1000 < 30. The
rule depends on the path only, so on any interpreter the files it picks were never trained on
(the shipped model was trained on Python 3.12.3's library; another version's files differ in
content, and the number of windows available with them). `text_path` reads a file, or every
`.py`/`.txt`/`.md` file under a folder, instead.

Documents are tokenized, each followed by EOS, concatenated, and cut into `num_windows`
consecutive windows of `seq_len` tokens (the training script's stream layout).
"""
from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

Doc = Tuple[str, str]  # (relative path, text)


def stdlib_validation(permille: int = 30, max_file_bytes: int = 400_000) -> List[Doc]:
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if {"site-packages", "dist-packages"} & set(path.relative_to(root).parts):
            continue
        if int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 1000 >= permille:
            continue
        if not path.is_file() or path.stat().st_size > max_file_bytes:
            continue
        try:
            docs.append((rel, path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    return docs


def text_path(path: str) -> List[Doc]:
    p = Path(path)
    if p.is_file():
        return [(p.name, p.read_text(encoding="utf-8"))]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.suffix in (".py", ".txt", ".md") and f.is_file())
        return [(f.relative_to(p).as_posix(), f.read_text(encoding="utf-8", errors="replace")) for f in files]
    raise FileNotFoundError(f"lab.data.path={path!r} is neither a file nor a folder")


def token_windows(tokenizer, docs: List[Doc], seq_len: int, num_windows: int,
                  eos_id: Optional[int] = None) -> np.ndarray:
    """int64 [num_windows, seq_len]: consecutive windows of the documents' token stream."""
    if seq_len <= 1 or num_windows <= 0:
        raise ValueError(f"need seq_len > 1 and num_windows > 0, got {seq_len} and {num_windows}")
    eos = tokenizer.eos_token_id if eos_id is None else eos_id
    need = seq_len * num_windows
    stream: List[int] = []
    for _, text in docs:
        stream += tokenizer(text, verbose=False)["input_ids"]  # whole files: past model_max_length (no warning)
        if eos is not None:
            stream.append(eos)
        if len(stream) >= need:
            break
    if len(stream) < need:
        raise ValueError(f"the held-out text has {len(stream)} tokens, {num_windows} windows of {seq_len} need {need}")
    return np.asarray(stream[:need], dtype=np.int64).reshape(num_windows, seq_len)
