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
A missing, misshaped or unexpected tensor and an unreadable file raise naming the tensor or file.

Legend: E experts, F expert intermediate, D hidden, V vocabulary.
"""
from __future__ import annotations

import json
import logging
import os
import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from safetensors import safe_open

from moe_infer.layers.attention import head_split
from moe_infer.quant import FP8, logical_shape
from moe_infer.layers.tensor_parallel import ShardGroup, padded_vocab
from moe_infer.models.arch import ModelArch

logger = logging.getLogger(__name__)

_INDEX = "model.safetensors.index.json"
_ALL = slice(None)
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class _Target:
    param: Optional[str]  # None: a known tensor this model does not need (non-local expert, tied head)
    shape: Tuple[int, ...]  # the checkpoint tensor's expected shape
    dst: tuple = (_ALL,)  # index into the parameter
    src: tuple = (_ALL,)  # index into the checkpoint tensor (fused experts: local rows)
    more: Tuple[Tuple[tuple, tuple], ...] = ()  # further (dst, src) copies (fused experts, uneven placement)
    fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # applied to each src read (GPT-OSS's layouts)

    def places(self) -> Tuple[Tuple[tuple, tuple], ...]:
        return ((self.dst, self.src),) + self.more


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


def _part(total: int, shard: ShardGroup) -> slice:
    """This rank's share [r * total / size, (r + 1) * total / size) of a dimension (all of it on one rank)."""
    if shard.size == 1:
        return _ALL
    n = total // shard.size
    return slice(shard.rank * n, (shard.rank + 1) * n)


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


def _runs(expert_ids: List[int]) -> List[Tuple[int, int, int]]:
    """(first slot, first expert, length) of each run of consecutive experts in consecutive slots."""
    runs: List[Tuple[int, int, int]] = []
    for slot, e in enumerate(expert_ids):
        if runs and runs[-1][1] + runs[-1][2] == e and runs[-1][0] + runs[-1][2] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((slot, e, 1))
    return runs


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


def _gpt_oss_expert_targets(arch: ModelArch, p: str, t: str, expert_ids: List[int], moe_tp: ShardGroup
                            ) -> Dict[str, _Target]:
    """GPT-OSS's fused experts (runs of local experts read at once, each run through a layout function):
      bf16   gate_up_proj [E, D, 2F] (gate, up in alternate columns) -> w13_E2FD [E, 2F, D] (gate; up halves),
             down_proj [E, F, D] -> w2_EDF [E, D, F], gate_up_proj_bias [E, 2F] (alternate) -> b13_E2F (halves),
             down_proj_bias [E, D] -> b2_ED
      mxfp4  gate_up_proj_blocks [E, 2F, D/32, 16] uint8 -> w13_E2FD [E, 2F, D/2] (rows to halves), its
             gate_up_proj_scales [E, 2F, D/32] -> w13_E2FD_scales; down_proj_blocks [E, D, F/32, 16] ->
             w2_EDF [E, D, F/2], down_proj_scales [E, D, F/32] -> w2_EDF_scales
    Under moe_tp each rank reads its F / moe_tp gate and up rows and down columns (mxfp4: whole 32-value blocks)."""
    E, F, D = arch.num_experts, arch.moe_intermediate_size, arch.hidden_size
    f_rows = _part(F, moe_tp)
    runs = [(slice(s0, s0 + n), slice(e0, e0 + n)) for s0, e0, n in _runs(expert_ids)]
    mxfp4 = arch.quant is not None and arch.quant.method == "mxfp4"
    if mxfp4 and moe_tp.size > 1 and (F // moe_tp.size) % 32:
        raise ValueError(f"mxfp4 experts: moe_intermediate_size {F} / {moe_tp.size} ranks cuts the 32-value blocks")

    def halves(t_nX: torch.Tensor, dim: int) -> torch.Tensor:  # alternate gate / up entries of dim -> [gate; up]
        gate, up = t_nX.unflatten(dim, (-1, 2)).unbind(dim + 1)
        return torch.cat((gate.narrow(dim, _start(f_rows), _len(f_rows, F)),
                          up.narrow(dim, _start(f_rows), _len(f_rows, F))), dim)

    def target(name: str, param: Optional[str], shape: Tuple[int, ...], fn) -> Tuple[str, _Target]:
        if param is None or not runs:
            return name, _Target(None, shape)
        places = [((dst,), (src,)) for dst, src in runs]
        return name, _Target(param, shape, places[0][0], places[0][1], tuple(places[1:]), fn)

    if mxfp4:
        blocks_F = slice(_start(f_rows) // 32, (_start(f_rows) + _len(f_rows, F)) // 32)
        out = dict((
            target(f"{p}.experts.gate_up_proj_blocks", f"{t}.w13_E2FD", (E, 2 * F, D // 32, 16),
                   lambda x: halves(x, 1).flatten(-2)),
            target(f"{p}.experts.gate_up_proj_scales", f"{t}.w13_E2FD_scales", (E, 2 * F, D // 32),
                   lambda x: halves(x, 1)),
            target(f"{p}.experts.down_proj_blocks", f"{t}.w2_EDF", (E, D, F // 32, 16),
                   lambda x: x[:, :, blocks_F].flatten(-2)),
            target(f"{p}.experts.down_proj_scales", f"{t}.w2_EDF_scales", (E, D, F // 32), lambda x: x[:, :, blocks_F]),
        ))
    else:
        out = dict((
            target(f"{p}.experts.gate_up_proj", f"{t}.w13_E2FD", (E, D, 2 * F), lambda x: halves(x, 2).transpose(1, 2)),
            target(f"{p}.experts.down_proj", f"{t}.w2_EDF", (E, F, D), lambda x: x[:, f_rows].transpose(1, 2)),
        ))
    out.update((
        target(f"{p}.experts.gate_up_proj_bias", f"{t}.b13_E2F", (E, 2 * F), lambda x: halves(x, 1)),
        target(f"{p}.experts.down_proj_bias", f"{t}.b2_ED", (E, D), None),
    ))
    return out


def _start(part: slice) -> int:
    return part.start or 0


def _len(part: slice, total: int) -> int:
    return (total if part.stop is None else part.stop) - (part.start or 0)


def _vocab_target(param: Optional[str], V: int, D: int, tp: ShardGroup) -> _Target:
    """This rank's rows of a [V, D] table (the last rank's share may run past V: padding rows stay zero)."""
    if param is None or tp.size == 1:
        return _Target(param, (V, D))
    n = padded_vocab(V, tp) // tp.size
    start = tp.rank * n
    stop = min(start + n, V)
    return _Target(param, (V, D), (slice(0, stop - start),), (slice(start, stop),))


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
        out.update(_mtp_targets(model, model.arch.num_layers + j, j, layer, names))
    return out


def _mtp_targets(model, i: int, j: int, layer, names: set) -> Dict[str, _Target]:
    """An MTP layer's tensors: its decoder block's as a decoder layer i's, and the inputs and head around it."""
    D, V, tp = model.arch.hidden_size, model.arch.vocab_size, model.shard.tp
    own = {f"layers.{i}.{name}": _Target(f"layers.{i}.{name}", (D,)) for name in ("enorm.weight", "hnorm.weight",
                                                                               "shared_head.norm.weight")}
    own[f"layers.{i}.eh_proj.weight"] = _Target(f"layers.{i}.eh_proj.weight", (D, 2 * D))
    own[f"layers.{i}.embed_tokens.weight"] = _vocab_target(f"layers.{i}.embed_tokens.weight", V, D, tp)
    own[f"layers.{i}.shared_head.head.weight"] = _vocab_target(f"layers.{i}.shared_head.head.weight", V, D, tp)
    block = _layer_targets(model, i, layer, names, True)
    block.update({"model." + name: tgt for name, tgt in own.items()})
    head, mine = f"layers.{i}.", f"mtp.{j}."
    return {name: tgt if tgt.param is None else dataclasses.replace(tgt, param=mine + tgt.param[len(head):])
            for name, tgt in block.items()}


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


def _block_index(idx: tuple, ndim: int, spec) -> tuple:
    """An index into a weight [..., N, K] (a tuple over its leading dims) as the index into its scales [..., Nb, Kb]:
    slices of N and K in whole blocks (a slice that cuts a block is refused: the shard would need part of a scale)."""
    out = []
    for dim, ix in enumerate(idx):
        block = {ndim - 2: spec.block_n, ndim - 1: spec.block_k}.get(dim)
        if block is None or not isinstance(ix, slice) or ix == _ALL:
            out.append(ix)
            continue
        start, stop = ix.start or 0, ix.stop
        if start % block or (stop is not None and stop % block):
            raise ValueError(f"a shard of rows/columns [{ix.start}, {ix.stop}) cuts the fp8 checkpoint's "
                             f"{block}-wide scale blocks: choose tp / placement so shards align to {block}")
        out.append(slice(start // block, None if stop is None else -(-stop // block)))
    return tuple(out)


def _scale_targets(targets: Dict[str, _Target], params: Dict[str, torch.Tensor], spec) -> Dict[str, _Target]:
    """The `weight_scale_inv` tensor of every checkpoint weight that lands in a quantized parameter: the same
    places, in blocks, into the parameter's `<name>_scale_inv` buffer."""
    out = {}
    for name, tgt in targets.items():
        if tgt.param is None:  # another rank's weight: its scales are known and not read either
            if name.endswith(".weight"):
                out[name + "_scale_inv"] = _Target(None, ())
            continue
        if params[tgt.param].dtype != FP8:
            continue
        if not name.endswith(".weight"):
            raise ValueError(f"fp8 checkpoint: tensor {name!r} (fused expert naming) has no per-weight scales; only "
                             f"per-expert tensors (experts.<e>.gate_proj.weight ...) are read quantized")
        n, k = tgt.shape[-2:]
        shape = tgt.shape[:-2] + spec.scale_shape(n, k)
        places = [(_block_index(d, len(params[tgt.param].shape), spec), _block_index(s, len(tgt.shape), spec))
                  for d, s in tgt.places()]
        out[name + "_scale_inv"] = _Target(tgt.param + "_scale_inv", shape, places[0][0], places[0][1],
                                           tuple(places[1:]))
    return out


def _packed_targets(targets: Dict[str, _Target], params: Dict[str, torch.Tensor], spec) -> Dict[str, _Target]:
    """compressed-tensors pack-quantized: each `<x>.weight` of an int4 parameter is read as `<x>.weight_packed` (int32
    [..., N, K / 8]) into the parameter and `<x>.weight_scale` ([..., N, K / group]) into its `_scale` buffer, at the
    same places with the column slices in words / groups; `<x>.weight_shape` is known and not read."""
    out = {}
    for name, tgt in targets.items():
        quantized = (tgt.param is not None and params[tgt.param].dtype == torch.int32) or (
            tgt.param is None and name.startswith("model.layers.") and name.endswith(".weight") and len(tgt.shape) >= 2
            and not name.endswith((".gate.weight", "shared_expert_gate.weight")))  # another rank's: known, not read
        if not quantized:
            out[name] = tgt
            continue
        n, k = tgt.shape[-2:]
        lead = tgt.shape[:-2]
        for suffix, per, param in (("_packed", 8, tgt.param), ("_scale", spec.group_size,
                                                               tgt.param and tgt.param + "_scale")):
            places = [(d, _column_index(s_, len(tgt.shape), per)) for d, s_ in tgt.places()]
            out[name + suffix] = _Target(param, lead + (n, k // per), places[0][0], places[0][1], tuple(places[1:]))
        out[name + "_shape"] = _Target(None, (2,))
    return out


def _column_index(idx: tuple, ndim: int, per: int) -> tuple:
    """An index into a weight [..., N, K] as the index into its packed words or groups along K (whole ones)."""
    out = []
    for dim, ix in enumerate(idx):
        if dim == ndim - 1 and isinstance(ix, slice) and ix != _ALL:
            start, stop = ix.start or 0, ix.stop
            if start % per or (stop is not None and stop % per):
                raise ValueError(f"a shard of columns [{ix.start}, {ix.stop}) cuts the int4 checkpoint's {per}-wide "
                                 f"words / groups: choose tp so shards align to {per}")
            ix = slice(start // per, None if stop is None else stop // per)
        out.append(ix)
    return tuple(out)


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
