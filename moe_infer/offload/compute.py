"""Expert compute for the offload stores: on device slots (any experts backend), and on the CPU.

`slot_experts` runs the layer's experts backend over the slot tensors a store hands out, with slot
ids in place of expert ids (-1: computed elsewhere): a backend with `fused_experts` (Triton) takes
them as they are, any other (the PyTorch reference) goes through a LocalDispatcher over the slots.
`gather_cpu_rows` + `cpu_experts` compute routed rows of experts whose weights are in host memory
(Fiddler-style), in the model dtype on the host cores: whole experts, or the first gate/up rows of an
expert the host shares with the link (offload/split.py), whose down projection the device finishes.

Legend: T tokens, D hidden, F expert intermediate, S slots, K top-k, r rows of one expert.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from moe_infer.experts.activation import SILU, ExpertAct, ExpertExtras
from moe_infer.experts.local_dispatch import LocalDispatcher

SlotCompute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def slot_extras(w13_S2FD: torch.Tensor, w2_SDF: torch.Tensor, act: ExpertAct = SILU,
                down_bias: bool = True) -> Optional[ExpertExtras]:
    """The extras of a call on slots (or one expert): the activation and the biases the layout attached to the
    weights (`expert_bias`, offload/layout.py); down_bias False: this rank adds no down bias (moe_tp rank > 0)."""
    b13, b2 = getattr(w13_S2FD, "expert_bias", None), getattr(w2_SDF, "expert_bias", None)
    if b13 is None and act == SILU:
        return None
    return ExpertExtras(act, b13, b2 if down_bias else None)


def slot_experts(experts_fn, x_TD: torch.Tensor, slot_ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                 w13_S2FD: torch.Tensor, w2_SDF: torch.Tensor, act: ExpertAct = SILU,
                 down_bias: bool = True) -> torch.Tensor:
    """out_TD = sum over k of weights * expert(slot_ids[t, k])(x[t]); ids -1 add nothing. Experts with biases or
    another activation (GPT-OSS): the slots' biases and `act` go to the backend as its extras."""
    extras = slot_extras(w13_S2FD, w2_SDF, act, down_bias)
    fused = getattr(experts_fn, "fused_experts", None)
    if fused is not None and (extras is None or getattr(w13_S2FD, "quant", None) is None
                              or w13_S2FD.quant.fmt in getattr(experts_fn, "fused_extras_formats", ())):
        kw = {} if extras is None else {"extras": extras}
        return fused(x_TD, slot_ids_TK, weights_TK, w13_S2FD, w2_SDF, 0, **kw)
    dispatcher = LocalDispatcher(w13_S2FD.shape[0])
    kw = {} if extras is None else {"extras": extras}
    return dispatcher.forward_experts(x_TD, slot_ids_TK, weights_TK,
                                      lambda x_RD, meta: experts_fn(x_RD, meta, w13_S2FD, w2_SDF, **kw))


def swiglu(x_rD: torch.Tensor, w13_2FD: torch.Tensor, w2_DF: torch.Tensor,
           extras: Optional[ExpertExtras] = None) -> torch.Tensor:
    """One expert on rows x_rD; extras: its activation and biases (b13 [2F], b2 [D] of this expert)."""
    h_r2F = x_rD @ w13_2FD.t()
    f = w2_DF.shape[1]
    if extras is None:
        return (F.silu(h_r2F[:, :f]) * h_r2F[:, f:]) @ w2_DF.t()
    if extras.b13_E2F is not None:
        h_r2F = h_r2F + extras.b13_E2F.to(h_r2F.dtype)
    y_rD = extras.act(h_r2F[:, :f], h_r2F[:, f:]) @ w2_DF.t()
    return y_rD if extras.b2_ED is None else y_rD + extras.b2_ED.to(y_rD.dtype)


def gate_up(x_rD: torch.Tensor, w13_2FD: torch.Tensor, f: int, c: Optional[int] = None) -> torch.Tensor:
    """act_rc = silu(x @ w1[:c].T) * (x @ w3[:c].T) in float32: the first c of the expert's f
    intermediate rows (all f when c is None), read from two contiguous ranges of w13 [gate; up]."""
    c = f if c is None else c
    return F.silu((x_rD @ w13_2FD[:c].t()).float()) * (x_rD @ w13_2FD[f:f + c].t()).float()


def to_device(values, device: torch.device, dtype=torch.int64) -> torch.Tensor:
    """A small host list (or numpy array) on the device without blocking the host (pinned staging on CUDA)."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type == "cuda":  # torch.tensor(numpy, pin_memory=True) refuses: pin the copy instead
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


@dataclass
class CpuRows:
    """The routed rows of the experts the CPU computes this step, already on the host."""

    t_idx_r: torch.Tensor  # on the device: the token of each row
    x_rD: torch.Tensor  # host
    e_r: List[int]
    w_r: torch.Tensor  # float32, host


def gather_cpu_rows(x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                    is_cpu_E: torch.Tensor) -> CpuRows:
    """Select and copy to the host the rows routed to CPU experts (ids: local, -1 = none). Call it
    before the GPU work of the step is queued: its host sync then waits for nothing but the router."""
    on_cpu_TK = (ids_TK >= 0) & is_cpu_E[ids_TK.clamp_min(0)]
    t_idx, k_idx = torch.nonzero(on_cpu_TK, as_tuple=True)  # the host sync of the CPU path
    return CpuRows(t_idx, x_TD.index_select(0, t_idx).cpu(), ids_TK[t_idx, k_idx].tolist(),
                   weights_TK[t_idx, k_idx].float().cpu())


def cpu_experts(rows: CpuRows, out_TD: torch.Tensor, host_weights: Callable[[int], Tuple[torch.Tensor, torch.Tensor]],
                shared: Optional[Dict[int, Tuple[int, torch.Tensor]]] = None, act: ExpertAct = SILU,
                down_bias: bool = True) -> torch.Tensor:
    """out_TD + the weighted outputs of `rows`, each expert computed on the host cores from
    host_weights(e) -> (w13_2FD, w2_DF); the result goes back without blocking the host. shared[e] =
    (c, w2_DF of e's device slot): the host computes only the gate/up rows [0:c) of expert e
    (offload/split.py) and the device multiplies them by the slot's w2[:, :c]. Experts with biases (the host
    weights' `expert_bias`) or another activation run whole (never shared) with them."""
    if not rows.e_r:
        return out_TD
    shared = shared or {}
    y_rD = torch.empty(rows.x_rD.shape, dtype=rows.x_rD.dtype, pin_memory=out_TD.is_cuda)
    if shared:
        y_rD.zero_()
    groups: Dict[int, List[int]] = {}
    for i, e in enumerate(rows.e_r):
        groups.setdefault(e, []).append(i)
    parts = []  # (rows of a shared expert, their weighted act [r, c] on the host, the slot's w2[:, :c])
    for e, idx in groups.items():
        idx_r = torch.tensor(idx, device="cpu")
        w13, w2 = host_weights(e)
        x_rD = rows.x_rD.index_select(0, idx_r)
        if e in shared:
            c, w2_DF = shared[e]
            act_rc = gate_up(x_rD, w13, w2.shape[1], c) * rows.w_r[idx_r, None]
            parts.append((idx, act_rc.to(x_rD.dtype), w2_DF[:, :c]))
        else:
            y = swiglu(x_rD, w13, w2, slot_extras(w13, w2, act, down_bias))
            y_rD[idx_r] = (y.float() * rows.w_r[idx_r, None]).to(y_rD.dtype)
    if len(parts) < len(groups):
        out_TD = out_TD.index_add(0, rows.t_idx_r, y_rD.to(out_TD.device, non_blocking=True))
    for idx, act_rc, w2_Dc in parts:
        if out_TD.is_cuda:
            act_rc = act_rc.pin_memory()
        t_idx = rows.t_idx_r[to_device(idx, rows.t_idx_r.device)]
        out_TD = out_TD.index_add(0, t_idx, act_rc.to(out_TD.device, non_blocking=True) @ w2_Dc.t())
    return out_TD
