"""Load an HF safetensors checkpoint (one file, or shards through model.safetensors.index.json).

Every checkpoint tensor maps to a `_Target`: a parameter of MoEModel, where in it the tensor goes
(q/k/v rows of the fused qkv_proj, gate/up halves of a fused gate_up_proj, one expert of a stacked
store) and the shape the checkpoint must have. Expert tensors come in either naming:
  fused       `mlp.experts.gate_up_proj` [E, 2F, D] (gate; up), `mlp.experts.down_proj` [E, D, F]
  per expert  `mlp.experts.{e}.gate_proj|up_proj|down_proj.weight` (Mixtral: `block_sparse_moe.
              experts.{e}.w1|w3|w2.weight`)
and only the experts local to each layer's dispatcher are read: slot s of the store holds logical
expert `dispatcher.local_expert_ids[s]` (contiguous `expert_start + s` by default; an EP placement
with hot-expert replicas may list any experts, a fused tensor is then read in runs of rows).
Under a mesh (`model.shard`) only this rank's part is read: its pipeline stage's layers (the others'
tensors are known but skipped), its query / KV heads, its rows of the intermediate dimensions and
of the vocabulary (tensor parallel), each routed expert's F / moe_tp rows.
A missing, misshaped or unexpected tensor and an unreadable file raise naming the tensor or file. The targets of
GPT-OSS's experts, the MTP layers and the quantized formats (fp8 scales, packed int4) are built in format_targets.py.

Legend: E experts, F expert intermediate, D hidden, V vocabulary.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Dict, List, Tuple

import torch
from safetensors import safe_open

from moe_infer.layers.attention import head_split
from moe_infer.layers.tensor_parallel import ShardGroup
from moe_infer.models.arch import ModelArch
from moe_infer.models.format_targets import (  # noqa: F401 - _block_index: tests read it here
    _ALL, _Target, _block_index, _gpt_oss_expert_targets, _mtp_targets, _packed_targets, _part, _runs, _scale_targets,
    _vocab_target,
)
from moe_infer.quant import logical_shape

logger = logging.getLogger(__name__)

_INDEX = "model.safetensors.index.json"
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def checkpoint_files(path: str) -> Dict[str, str]:
    """checkpoint tensor name -> the safetensors file holding it."""
    index = os.path.join(path, _INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError) as e:
            raise ValueError(f"corrupt checkpoint index {index}: {e}") from None
        return {name: os.path.join(path, fname) for name, fname in weight_map.items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        raise FileNotFoundError(f"no model.safetensors or {_INDEX} in {path!r}")
    return {name: single for name in _open(single).keys()}


def _open(file: str):
    if not os.path.isfile(file):
        raise FileNotFoundError(f"checkpoint file {file} is missing")
    try:
        return safe_open(file, framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for bad headers / sizes
        raise ValueError(f"corrupt safetensors file {file}: {e}") from None


def _attn_targets(arch: ModelArch, i: int, tp: ShardGroup) -> Dict[str, _Target]:
    p, t, D, d = f"model.layers.{i}.self_attn", f"layers.{i}.self_attn", arch.hidden_size, arch.head_dim
    heads = head_split(arch.num_heads, arch.num_kv_heads, tp)
    q, kv = heads.num_heads * d, heads.num_kv_heads * d  # this rank's rows
    full = {"q": arch.q_size, "k": arch.kv_size, "v": arch.kv_size}
    src = {"q": slice(heads.q_start * d, heads.q_start * d + q), "k": slice(heads.kv_start * d, heads.kv_start * d + kv)}
    src["v"] = src["k"]
    if tp.size == 1:
        src = {name: _ALL for name in src}
    rows = {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}
    out = {}
    for name, r in rows.items():
        out[f"{p}.{name}_proj.weight"] = _Target(f"{t}.qkv_proj.weight", (full[name], D), (r,), (src[name],))
        if arch.qkv_bias:
            out[f"{p}.{name}_proj.bias"] = _Target(f"{t}.qkv_proj.bias", (full[name],), (r,), (src[name],))
    out[f"{p}.o_proj.weight"] = _Target(f"{t}.o_proj.weight", (D, arch.q_size), src=(_ALL, src["q"]))
    if arch.o_bias:
        out[f"{p}.o_proj.bias"] = _Target(f"{t}.o_proj.bias", (D,))
    if arch.qk_norm == "head":
        out[f"{p}.q_norm.weight"] = _Target(f"{t}.q_norm.weight", (d,))
        out[f"{p}.k_norm.weight"] = _Target(f"{t}.k_norm.weight", (d,))
    elif arch.qk_norm == "proj":
        out[f"{p}.q_norm.weight"] = _Target(f"{t}.q_norm.weight", (arch.q_size,), src=(src["q"],))
        out[f"{p}.k_norm.weight"] = _Target(f"{t}.k_norm.weight", (arch.kv_size,), src=(src["k"],))
    if arch.attn_sinks:
        heads_src = _ALL if tp.size == 1 else slice(heads.q_start, heads.q_start + heads.num_heads)
        out[f"{p}.sinks"] = _Target(f"{t}.sinks", (arch.num_heads,), src=(heads_src,))
    return out


def _mla_targets(arch: ModelArch, i: int, tp: ShardGroup) -> Dict[str, _Target]:
    """Multi-head latent attention (moe_infer/layers/mla.py): this rank's heads' rows of q_proj / q_b_proj and
    kv_b_proj and columns of o_proj; the compression and its norms whole."""
    p, t, D, mla = f"model.layers.{i}.self_attn", f"layers.{i}.self_attn", arch.hidden_size, arch.mla
    H, c, r = arch.num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim
    heads = _part(H, tp)
    def rows(per_head: int) -> slice:
        return _ALL if heads == _ALL else slice(heads.start * per_head, heads.stop * per_head)
    q_rows, kv_rows, o_cols = rows(mla.qk_head_dim), rows(mla.qk_nope_head_dim + mla.v_head_dim), rows(mla.v_head_dim)
    out = {
        f"{p}.kv_a_proj_with_mqa.weight": _Target(f"{t}.kv_a_proj_with_mqa.weight", (c + r, D)),
        f"{p}.kv_a_layernorm.weight": _Target(f"{t}.kv_a_layernorm.weight", (c,)),
        f"{p}.kv_b_proj.weight": _Target(f"{t}.kv_b_proj.weight", (H * (mla.qk_nope_head_dim + mla.v_head_dim), c),
                                         src=(kv_rows,)),
        f"{p}.o_proj.weight": _Target(f"{t}.o_proj.weight", (D, H * mla.v_head_dim), src=(_ALL, o_cols)),
    }
    if mla.q_lora_rank is None:
        out[f"{p}.q_proj.weight"] = _Target(f"{t}.q_proj.weight", (H * mla.qk_head_dim, D), src=(q_rows,))
    else:
        Q = mla.q_lora_rank
        out[f"{p}.q_a_proj.weight"] = _Target(f"{t}.q_a_proj.weight", (Q, D))
        out[f"{p}.q_a_layernorm.weight"] = _Target(f"{t}.q_a_layernorm.weight", (Q,))
        out[f"{p}.q_b_proj.weight"] = _Target(f"{t}.q_b_proj.weight", (H * mla.qk_head_dim, Q), src=(q_rows,))
        if arch.qkv_bias:
            out[f"{p}.q_a_proj.bias"] = _Target(f"{t}.q_a_proj.bias", (Q,))
    if arch.qkv_bias:
        out[f"{p}.kv_a_proj_with_mqa.bias"] = _Target(f"{t}.kv_a_proj_with_mqa.bias", (c + r,))
    if arch.o_bias:
        out[f"{p}.o_proj.bias"] = _Target(f"{t}.o_proj.bias", (D,))
    return out


def _swiglu_targets(ckpt: str, param: str, D: int, F: int, tp: ShardGroup) -> Dict[str, _Target]:
    """A dense gate/up/down MLP onto a module with a fused gate_up_proj [2F, D] and down_proj (this rank's
    F / tp rows of gate and up, columns of down)."""
    Fl, rows = F // tp.size, _part(F, tp)
    return {
        f"{ckpt}.gate_proj.weight": _Target(f"{param}.gate_up_proj.weight", (F, D), (slice(0, Fl),), (rows,)),
        f"{ckpt}.up_proj.weight": _Target(f"{param}.gate_up_proj.weight", (F, D), (slice(Fl, 2 * Fl),), (rows,)),
        f"{ckpt}.down_proj.weight": _Target(f"{param}.down_proj.weight", (D, F), src=(_ALL, rows)),
    }


def _expert_targets(arch: ModelArch, i: int, expert_ids: List[int], names: set, moe_tp: ShardGroup
                    ) -> Dict[str, _Target]:
    """expert_ids[s]: the logical expert held in local slot s of this layer's store (its F / moe_tp rows)."""
    p, t = f"model.layers.{i}.mlp", f"layers.{i}.mlp.store"
    if arch.expert_layout == "gpt_oss":
        return _gpt_oss_expert_targets(arch, p, t, expert_ids, moe_tp)
    if arch.quant is not None and arch.quant.method == "mxfp4":
        raise ValueError(f"{arch.architecture}: mxfp4 experts are read in GPT-OSS's layout only")
    E, F, D = arch.num_experts, arch.moe_intermediate_size, arch.hidden_size
    Fl, f_rows = F // moe_tp.size, _part(F, moe_tp)
    gate_dst, up_dst = (_ALL, slice(0, Fl)), (_ALL, slice(Fl, 2 * Fl))
    if f"{p}.experts.gate_up_proj" in names or f"{p}.experts.down_proj" in names:
        runs = [(slice(s0, s0 + n), slice(e0, e0 + n)) for s0, e0, n in _runs(expert_ids)]
        up_rows = _ALL if moe_tp.size == 1 else slice(F + f_rows.start, F + f_rows.stop)
        if moe_tp.size == 1:  # gate and up rows together, as stored
            gate_up = [((dst,), (src,)) for dst, src in runs]
        else:
            gate_up = [pl for dst, src in runs for pl in (((dst, gate_dst[1]), (src, f_rows)),
                                                          ((dst, up_dst[1]), (src, up_rows)))]
        down = [((dst,), (src, _ALL, f_rows) if moe_tp.size > 1 else (src,)) for dst, src in runs]

        def fused(param: str, shape: Tuple[int, ...], places: list) -> _Target:
            if not places:
                return _Target(None, shape)
            return _Target(param, shape, places[0][0], places[0][1], tuple(places[1:]))

        return {
            f"{p}.experts.gate_up_proj": fused(f"{t}.w13_E2FD", (E, 2 * F, D), gate_up),
            f"{p}.experts.down_proj": fused(f"{t}.w2_EDF", (E, D, F), down),
        }
    mixtral = f"{p}.experts.0.w1.weight" in names
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    slots_of = {e: [s for s, x in enumerate(expert_ids) if x == e] for e in range(E)}
    out = {}
    for e in range(E):
        slots = slots_of[e]

        def tgt(param: str, shape: Tuple[int, ...], rows: tuple, src: tuple) -> _Target:
            if not slots:
                return _Target(None, shape)
            more = tuple(((s,) + rows, src) for s in slots[1:])
            return _Target(param, shape, (slots[0],) + rows, src, more)

        out[f"{p}.experts.{e}.{gate}.weight"] = tgt(f"{t}.w13_E2FD", (F, D), gate_dst[1:], (f_rows,))
        out[f"{p}.experts.{e}.{up}.weight"] = tgt(f"{t}.w13_E2FD", (F, D), up_dst[1:], (f_rows,))
        out[f"{p}.experts.{e}.{down}.weight"] = tgt(f"{t}.w2_EDF", (D, F), (), (_ALL, f_rows))
    return out


def weight_targets(model, names: set) -> Dict[str, _Target]:
    """Every tensor the checkpoint must (or may) hold, in the checkpoint's names (after
    `block_sparse_moe` -> `mlp`), for this model's arch, pipeline stage, tensor shards and local experts."""
    arch: ModelArch = model.arch
    shard = model.shard
    D, V, tp = arch.hidden_size, arch.vocab_size, shard.tp
    first, last, tied = shard.is_first_stage, shard.is_last_stage, arch.tie_word_embeddings
    embed_param = "embed_tokens.weight" if first else ("lm_head.weight" if tied and last else None)
    out = {
        "model.embed_tokens.weight": _vocab_target(embed_param, V, D, tp),
        "model.norm.weight": _Target("norm.weight" if last else None, (D,)),
        "lm_head.weight": _vocab_target("lm_head.weight" if last and not tied else None, V, D, tp),
    }
    for i, layer in enumerate(model.layers):
        out.update(_layer_targets(model, i, layer, names, i in model.local_layers))
    for j, layer in enumerate(model.mtp or ()):  # MTP layers (models/mtp.py): model.layers.{L + j}.* -> mtp.{j}.*
        i = model.arch.num_layers + j
        out.update(_mtp_targets(model, i, j, _layer_targets(model, i, layer, names, True)))
    return out


def _layer_targets(model, i: int, layer, names: set, local: bool) -> Dict[str, _Target]:
    """Decoder layer i's tensors; not local: known, not read (another stage's layer, a placeholder)."""
    arch: ModelArch = model.arch
    D, tp, shard = arch.hidden_size, model.shard.tp, model.shard
    layer_out = {
        f"model.layers.{i}.input_layernorm.weight": _Target(f"layers.{i}.input_layernorm.weight", (D,)),
        f"model.layers.{i}.post_attention_layernorm.weight": _Target(
            f"layers.{i}.post_attention_layernorm.weight", (D,)),
    }
    layer_out.update(_mla_targets(arch, i, tp) if arch.mla is not None else _attn_targets(arch, i, tp))
    p, t = f"model.layers.{i}.mlp", f"layers.{i}.mlp"
    if not (layer.is_moe if local else arch.is_moe_layer(i)):
        layer_out.update(_swiglu_targets(p, t, D, arch.intermediate_size, tp))
    else:
        router = "router" if arch.router_bias else "gate"  # GPT-OSS: mlp.router.weight / .bias
        layer_out[f"{p}.{router}.weight"] = _Target(f"{t}.gate.weight", (arch.num_experts, D))
        if arch.router_bias:
            layer_out[f"{p}.router.bias"] = _Target(f"{t}.gate.bias", (arch.num_experts,))
        if arch.has_score_bias:
            layer_out[f"{p}.gate.e_score_correction_bias"] = _Target(f"{t}.e_score_correction_bias",
                                                                     (arch.num_experts,))
        expert_ids = local_expert_ids(layer.mlp.dispatcher, arch.num_experts) if local else []
        layer_out.update(_expert_targets(arch, i, expert_ids, names, shard.moe_tp))
        if arch.shared_expert_intermediate_size:
            shared_F = arch.shared_expert_intermediate_size
            layer_out.update(_swiglu_targets(f"{p}.{arch.shared_expert_name}", f"{t}.shared_expert", D, shared_F,
                                             tp))
            if arch.shared_expert_gated:
                layer_out[f"{p}.shared_expert_gate.weight"] = _Target(f"{t}.shared_expert.gate.weight", (1, D))
    if not local:  # another stage's layer: known, not read
        layer_out = {name: _Target(None, tgt.shape) for name, tgt in layer_out.items()}
    return layer_out


def local_expert_ids(dispatcher, num_experts: int) -> List[int]:
    """Logical expert of each local slot: `local_expert_ids` (EP placements, replicas) or the
    contiguous range [expert_start, expert_start + num_local_experts)."""
    ids = getattr(dispatcher, "local_expert_ids", None)
    if ids is None:
        ids = range(dispatcher.expert_start, dispatcher.expert_start + dispatcher.num_local_experts)
    ids = [int(e) for e in ids]
    if len(ids) != dispatcher.num_local_experts or any(not 0 <= e < num_experts for e in ids):
        raise ValueError(f"dispatcher's local experts {ids} do not fit {dispatcher.num_local_experts} slots "
                         f"of {num_experts} experts")
    return ids


def _canonical(name: str) -> str:
    return name.replace(".block_sparse_moe.", ".mlp.")


def load_weights(model, path: str) -> None:
    """Fill every parameter of `model` from the checkpoint folder `path` (in place)."""
    files = checkpoint_files(path)
    by_canon = {_canonical(n): n for n in files}
    # a packed int4 checkpoint names `<x>.weight_packed` where others name `<x>.weight` (the naming detection reads it)
    targets = weight_targets(model, set(by_canon) | {c[:-len("_packed")] for c in by_canon if c.endswith("_packed")})
    params = dict(model.named_parameters(remove_duplicate=False))
    quant = model.arch.quant
    stored = quant is not None and not quant.online  # the checkpoint holds the scales (else: quantized as read)
    # the stored scales: fp8's `_scale_inv`, mxfp4's `_scales` (not the attention's k_scale / v_scale)
    scale_suffix = {"fp8": ("_scale_inv",), "mxfp4": ("_scales",)}.get(quant.method, ()) if stored else ()
    params.update((n, b) for n, b in model.named_buffers() if n.endswith(("e_score_correction_bias",) + scale_suffix))
    if stored and quant.method == "int4":  # the scales of the int4 weights (not the attention's k_scale / v_scale)
        params.update((n, b) for n, b in model.named_buffers()
                      if n.endswith("_scale") and getattr(params.get(n[:-len("_scale")]), "quant", None) is not None)
        targets = _packed_targets(targets, params, quant)
    elif stored and quant.method == "fp8":
        targets.update(_scale_targets(targets, params, quant))
    extra = _extra_layers(model, by_canon)
    unexpected = sorted(n for c, n in by_canon.items()
                        if c not in targets and c not in extra and not c.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise ValueError(f"unexpected tensors in checkpoint {path!r}: {_few(unexpected)}")
    optional = {"lm_head.weight"} if model.arch.tie_word_embeddings else set()
    missing = sorted(c for c, t in targets.items() if c not in by_canon and t.param is not None and c not in optional)
    if missing:
        raise ValueError(f"checkpoint {path!r} is missing tensors: {_few(missing)}")
    covered = {t.param for t in targets.values() if t.param is not None}
    if model.arch.tie_word_embeddings and model.embed_tokens is not None and model.lm_head is not None:
        covered.add("lm_head.weight")  # the same parameter as the embedding
    uncovered = sorted(n for n in params if n not in covered)
    if uncovered:  # a parameter no checkpoint tensor maps to: a bug in weight_targets, not in the checkpoint
        raise RuntimeError(f"no checkpoint tensor maps to parameters: {_few(uncovered)}")
    handles: Dict[str, object] = {}
    for canon, name in by_canon.items():
        tgt = targets.get(canon)
        if tgt is None or tgt.param is None:
            continue
        file = files[name]
        if file not in handles:
            handles[file] = _open(file)
        _copy_one(handles[file], file, name, tgt, params[tgt.param])


def _extra_layers(model, by_canon: Dict[str, str]) -> set:
    """Tensors of the layers after the decoder's last that the config declares as multi-token-prediction
    (MTP) layers (DeepSeek-V3's `num_nextn_predict_layers`, `model.layers.61.*`): known and not read (logged),
    unless the model built them (`load_model(..., mtp=True)`: then they are targets, `_mtp_targets`)."""
    num_mtp = int(getattr(model.hf_config, "num_nextn_predict_layers", 0) or 0)
    if not num_mtp or model.mtp is not None:  # built: read as targets (_mtp_targets)
        return set()
    first = model.arch.num_layers
    prefixes = tuple(f"model.layers.{first + j}." for j in range(num_mtp))
    extra = {c for c in by_canon if c.startswith(prefixes)}
    if extra:
        logger.info("%d tensors of %d multi-token-prediction layer(s) left unread (load_model(..., mtp=True) "
                    "reads them)", len(extra), num_mtp)
    return extra


def _copy_one(handle, file: str, name: str, tgt: _Target, param: torch.Tensor) -> None:
    try:
        sl = handle.get_slice(name)
        shape = tuple(sl.get_shape())
    except Exception as e:
        raise ValueError(f"corrupt safetensors file {file}: cannot read tensor {name!r}: {e}") from None
    if shape != tgt.shape:
        raise ValueError(f"tensor {name!r} has shape {list(shape)}, expected {list(tgt.shape)} (file {file})")
    fmt = getattr(param, "quant", None)
    for dst_idx, src_idx in tgt.places():
        try:
            src = handle.get_tensor(name) if all(i == _ALL for i in src_idx) else sl[src_idx]
        except Exception as e:
            raise ValueError(f"corrupt safetensors file {file}: cannot read tensor {name!r}: {e}") from None
        if tgt.fn is not None:
            src = tgt.fn(src)
        if fmt is not None and src.dtype in _FLOAT_DTYPES:  # a bf16 checkpoint quantized as it is read
            want = torch.empty(logical_shape(param), device="meta")[dst_idx].shape
            if tuple(src.shape) != tuple(want):
                raise ValueError(f"tensor {name!r} slice {list(src.shape)} does not fit parameter slice {list(want)}")
            with torch.no_grad():
                fmt.store(param, dst_idx, src.to(param.device))
            continue
        dst = param[dst_idx] if dst_idx != (_ALL,) else param
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"tensor {name!r} slice {list(src.shape)} does not fit parameter slice {list(dst.shape)}")
        with torch.no_grad():
            dst.copy_(src)


def _few(names: List[str], k: int = 6) -> str:
    shown = ", ".join(names[:k])
    return shown + (f" ... ({len(names)} in all)" if len(names) > k else "")
