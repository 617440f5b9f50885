"""Reading a checkpoint folder's config: transformers' config, then the family's ModelArch (`load_arch`).

Apart from arch.py (the dataclass) so that the family registry (families.py), which builds ModelArch, and this
entry point, which asks the registry, import each other in one direction only: arch <- families <- hf_config.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any, Tuple

from moe_infer.models.arch import ModelArch, merge_eos
from moe_infer.models.families import family_for


def import_transformers_config() -> None:
    """Import transformers with its config classes (AutoConfig): the seconds of `import transformers`, most of them
    its lazy-module set-up, which reads the `__all__` of every model file it ships, spent once per process. The
    engine times this apart from reading the config (startup_timings.py: transformers_import)."""
    from transformers import AutoConfig  # noqa: F401


def load_hf_config(path: str) -> Any:
    """transformers.AutoConfig of a LOCAL checkpoint folder (never the Hub)."""
    from transformers import AutoConfig

    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path!r} is not a local folder")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"no config.json in model folder {path!r}")
    return AutoConfig.from_pretrained(path, local_files_only=True)


def arch_from_config(config: Any, extra_eos: Any = None) -> ModelArch:
    arch = family_for(config).parse(config)
    return replace(arch, eos_token_ids=merge_eos(arch.eos_token_ids, extra_eos))


def load_arch(path: str) -> Tuple[ModelArch, Any]:
    """(ModelArch, transformers config) of a local checkpoint folder."""
    config = load_hf_config(path)
    extra_eos = None
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            extra_eos = json.load(f).get("eos_token_id")
    return arch_from_config(config, extra_eos), config
