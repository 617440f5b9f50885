"""Model files shipped inside the package.

`tiny_moe/` is a small Qwen3-MoE trained on the Python standard library by
`scripts/train_tiny_moe.py` (model card: `docs/tiny_moe.md`). It is the engine's embedded default
model and the oracle checkpoint for parity tests: transformers loads it as it is.
"""
from pathlib import Path

TINY_MOE_DIR = Path(__file__).resolve().parent / "tiny_moe"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def default_model_path() -> str:
    """Folder of the shipped tiny MoE checkpoint; a clear error where it is missing or incomplete."""
    missing = [name for name in _REQUIRED_FILES if not (TINY_MOE_DIR / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the shipped tiny MoE checkpoint at {TINY_MOE_DIR} lacks {', '.join(missing)}; "
            "reinstall moe_infer with its package data, or rebuild it with "
            f"`python scripts/train_tiny_moe.py --out-dir {TINY_MOE_DIR}` (needs a GPU for the full run)")
    return str(TINY_MOE_DIR)
