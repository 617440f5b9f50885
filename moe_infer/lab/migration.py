"""Moving from one placement to the next with as few expert-weight copies as possible.

A plan says which experts each GPU holds; which GPU index gets which set is free (GPUs are
interchangeable inside a node), and so is the slot order inside a GPU. `align` relabels a new
plan's GPUs (inside each node) and slots so that as many slots as possible keep the expert they
hold now; the GPU loads and the imbalance do not change. `moves` lists the copies that remain.

Legend: L MoE layers, P physical slots, N GPUs, S slots per GPU.
"""
from __future__ import annotations

from typing import List, Tuple

import numpy as np

from moe_infer.lab.eplb import Plan


def _align_gpu(new_S: np.ndarray, old_S: np.ndarray) -> np.ndarray:
    """new_S reordered so that experts also in old_S sit in old_S's slots."""
    keep_S = np.isin(old_S, new_S)
    out = np.where(keep_S, old_S, -1)
    out[~keep_S] = new_S[~np.isin(new_S, old_S)]
    return out


def _match(overlap_AB: np.ndarray) -> np.ndarray:
    """Greedy matching of new GPUs (rows) to old GPUs (columns), the largest overlaps first; returns
    the old GPU of each new one."""
    n = overlap_AB.shape[0]
    old_of = np.full(n, -1)
    taken = np.zeros(n, dtype=bool)
    for flat in np.argsort(-overlap_AB, axis=None, kind="stable"):
        a, b = divmod(int(flat), n)
        if overlap_AB[a, b] == 0:
            break
        if old_of[a] < 0 and not taken[b]:
            old_of[a], taken[b] = b, True
    old_of[old_of < 0] = np.flatnonzero(~taken)  # no overlap left: any order
    return old_of


def align(current: Plan, new: Plan) -> Plan:
    """`new` with GPUs and slots relabelled to keep the most experts where `current` has them."""
    if (current.phy2log_LP.shape != new.phy2log_LP.shape or current.num_gpus != new.num_gpus):
        raise ValueError("plans of different shapes (replica count, GPUs or layers) cannot be aligned")
    N, S, E = new.num_gpus, new.slots_per_gpu, new.num_experts
    per_node = N // new.num_nodes
    out = np.empty_like(new.phy2log_LP)
    for layer in range(new.phy2log_LP.shape[0]):
        old_NS = current.phy2log_LP[layer].reshape(N, S)
        new_NS = new.phy2log_LP[layer].reshape(N, S)
        for node in range(new.num_nodes):
            g = slice(node * per_node, (node + 1) * per_node)
            inc_new = np.zeros((per_node, E), dtype=np.int64)
            inc_old = np.zeros((per_node, E), dtype=np.int64)
            np.put_along_axis(inc_new, new_NS[g], 1, axis=1)
            np.put_along_axis(inc_old, old_NS[g], 1, axis=1)
            old_of = _match(inc_new @ inc_old.T)
            for a, b in enumerate(old_of):
                gb = node * per_node + b
                out[layer, gb * S:(gb + 1) * S] = _align_gpu(new_NS[node * per_node + a], old_NS[gb])
    return Plan(out, new.num_experts, new.num_gpus, new.num_nodes)


def moves(current: Plan, new: Plan) -> List[Tuple[int, int, int]]:
    """(layer, physical slot, expert) for every slot whose expert changes: one weight copy each."""
    changed = np.argwhere(current.phy2log_LP != new.phy2log_LP)
    return [(int(layer), int(p), int(new.phy2log_LP[layer, p])) for layer, p in changed]
