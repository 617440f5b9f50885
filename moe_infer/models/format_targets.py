"""The checkpoint-tensor targets of the weight loader (moe_infer/models/loader.py) beyond the plain bf16 layout:
the `_Target` record and the index helpers they share, GPT-OSS's fused experts (bf16 and mxfp4 blocks), the
multi-token-prediction layers' own tensors, fp8 block scales (`_scale_targets`) and compressed-tensors' packed int4
words and group scales (`_packed_targets`).

Legend: E experts, F expert intermediate, D hidden, V vocabulary.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from moe_infer.layers.tensor_parallel import ShardGroup, padded_vocab
from moe_infer.models.arch import ModelArch
from moe_infer.quant import FP8

_ALL = slice(None)


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


def _part(total: int, shard: ShardGroup) -> slice:
    """This rank's share [r * total / size, (r + 1) * total / size) of a dimension (all of it on one rank)."""
    if shard.size == 1:
        return _ALL
    n = total // shard.size
    return slice(shard.rank * n, (shard.rank + 1) * n)


def _runs(expert_ids: List[int]) -> List[Tuple[int, int, int]]:
    """(first slot, first expert, length) of each run of consecutive experts in consecutive slots."""
    runs: List[Tuple[int, int, int]] = []
    for slot, e in enumerate(expert_ids):
        if runs and runs[-1][1] + runs[-1][2] == e and runs[-1][0] + runs[-1][2] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((slot, e, 1))
    return runs


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


def _mtp_targets(model, i: int, j: int, block: Dict[str, _Target]) -> Dict[str, _Target]:
    """An MTP layer's tensors: its decoder block's (block: as decoder layer i's targets), and the inputs and head
    around it."""
    D, V, tp = model.arch.hidden_size, model.arch.vocab_size, model.shard.tp
    own = {f"layers.{i}.{name}": _Target(f"layers.{i}.{name}", (D,)) for name in ("enorm.weight", "hnorm.weight",
                                                                               "shared_head.norm.weight")}
    own[f"layers.{i}.eh_proj.weight"] = _Target(f"layers.{i}.eh_proj.weight", (D, 2 * D))
    own[f"layers.{i}.embed_tokens.weight"] = _vocab_target(f"layers.{i}.embed_tokens.weight", V, D, tp)
    own[f"layers.{i}.shared_head.head.weight"] = _vocab_target(f"layers.{i}.shared_head.head.weight", V, D, tp)
    block = dict(block)
    block.update({"model." + name: tgt for name, tgt in own.items()})
    head, mine = f"layers.{i}.", f"mtp.{j}."
    return {name: tgt if tgt.param is None else dataclasses.replace(tgt, param=mine + tgt.param[len(head):])
            for name, tgt in block.items()}


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
