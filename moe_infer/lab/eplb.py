"""The EPLB planner: replicate hot experts and pack the replicas onto nodes, then GPUs.

The algorithm of DeepSeek's EPLB (hierarchical mode), written here over numpy arrays, with two
changes our placement format needs or allows:
  1. pack expert groups onto nodes, balancing the nodes' load (a group: experts a group-limited
     router treats together; without groups every expert is its own group);
  2. inside each node, give the node's spare slots one at a time to the expert whose load per
     replica is highest (an expert gets at most one replica per GPU of the node);
  3. pack each node's replicas onto its GPUs, S slots per GPU, heaviest replica first onto the
     lightest GPU with room that does not hold that expert yet (our dispatcher's placement may not
     put one expert twice on a rank); then improve by pairwise swaps between the most loaded GPU
     and the others while that lowers the maximum (EPLB stops after the greedy pass).
A replicated expert's load is split evenly over its replicas: the EP dispatcher sends its rows
round-robin over them. Physical slot p lives on GPU p // S, GPU g on node g // (N / nodes).

Legend: L MoE layers, E logical experts, P physical slots, N GPUs, S slots per GPU, G groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass(frozen=True)
class Plan:
    phy2log_LP: np.ndarray  # int64: the logical expert in each physical slot of each layer
    num_experts: int
    num_gpus: int
    num_nodes: int = 1

    @property
    def num_physical(self) -> int:  # P
        return self.phy2log_LP.shape[1]

    @property
    def slots_per_gpu(self) -> int:  # S
        return self.num_physical // self.num_gpus

    @property
    def num_redundant(self) -> int:
        return self.num_physical - self.num_experts

    @property
    def memory_overhead(self) -> float:
        """Extra expert memory of the replicas, as a fraction of the model's expert memory."""
        return self.num_redundant / self.num_experts

    def count_LE(self) -> np.ndarray:
        """int64 [L, E]: replicas of each logical expert."""
        return np.stack([np.bincount(row, minlength=self.num_experts) for row in self.phy2log_LP])

    def gpu_load(self, load_LE: np.ndarray) -> np.ndarray:
        """float64 [L, N]: each GPU's load when every expert's load splits evenly over its replicas."""
        load_LE = np.asarray(load_LE, dtype=np.float64)
        per_replica_LE = load_LE / np.maximum(self.count_LE(), 1)
        slot_LP = np.take_along_axis(per_replica_LE, self.phy2log_LP, axis=1)
        return slot_LP.reshape(len(slot_LP), self.num_gpus, self.slots_per_gpu).sum(-1)


def replicate(weight_XE: np.ndarray, num_slots: int, max_replicas: int) -> np.ndarray:
    """int64 [X, E] replica counts summing to num_slots per row: each spare slot goes to the expert with
    the highest load per replica among those with fewer than max_replicas."""
    X, E = weight_XE.shape
    if not E <= num_slots <= E * max_replicas:
        raise ValueError(f"{num_slots} slots cannot hold {E} experts with 1..{max_replicas} replicas each")
    count_XE = np.ones((X, E), dtype=np.int64)
    rows = np.arange(X)
    for _ in range(num_slots - E):
        score_XE = np.where(count_XE < max_replicas, weight_XE / count_XE, -np.inf)
        count_XE[rows, np.argmax(score_XE, axis=1)] += 1
    return count_XE


def balanced_packing(weight_N: np.ndarray, key_N: np.ndarray, num_packs: int, refine: bool = True) -> np.ndarray:
    """int64 [n] pack of each item: n / num_packs items a pack, items of equal key in different packs,
    the heaviest pack as light as the greedy pass and the swaps below make it."""
    n = len(weight_N)
    if n % num_packs:
        raise ValueError(f"{n} items do not split evenly into {num_packs} packs")
    cap, num_keys = n // num_packs, int(key_N.max()) + 1
    pack_N = np.full(n, -1, dtype=np.int64)
    load_G, count_G = np.zeros(num_packs), np.zeros(num_packs, dtype=np.int64)
    holds_GK = np.zeros((num_packs, num_keys), dtype=bool)
    for i in np.argsort(-weight_N, kind="stable"):
        k = key_N[i]
        ok_G = (count_G < cap) & ~holds_GK[:, k]
        if not ok_G.any():  # the packs with room all hold k: move an item out of one of them
            _make_room(i, weight_N, key_N, pack_N, load_G, holds_GK, count_G, cap)
            ok_G = (count_G < cap) & ~holds_GK[:, k]
        g = int(np.flatnonzero(ok_G)[np.argmin(load_G[ok_G])])
        pack_N[i], load_G[g], count_G[g], holds_GK[g, k] = g, load_G[g] + weight_N[i], count_G[g] + 1, True
    if refine and num_packs > 1:
        _refine(weight_N, key_N, pack_N, load_G, holds_GK)
    return pack_N


def _make_room(i, weight_N, key_N, pack_N, load_G, holds_GK, count_G, cap) -> None:
    """Item i fits nowhere: move an item j from a full pack h (h lacks key i) into a pack g with room
    (g lacks key j), so that i can go to h."""
    k = key_N[i]
    for g in np.flatnonzero(count_G < cap):
        for j in np.flatnonzero(pack_N >= 0):
            h = pack_N[j]
            if h != g and not holds_GK[h, k] and not holds_GK[g, key_N[j]]:
                pack_N[j] = g
                load_G[h] -= weight_N[j]
                load_G[g] += weight_N[j]
                holds_GK[h, key_N[j]], holds_GK[g, key_N[j]] = False, True
                count_G[h] -= 1
                count_G[g] += 1
                return
    raise ValueError(f"cannot place a replica of expert {k}: every pack with room already holds it")


def _refine(weight_N, key_N, pack_N, load_G, holds_GK, max_rounds: int = 10_000) -> None:
    """Swap an item of the heaviest pack with an item of another pack while the larger of the two
    packs' new loads is below the heaviest load (strictly, by a margin: terminates)."""
    for _ in range(max_rounds):
        top = int(np.argmax(load_G))
        mine = np.flatnonzero(pack_N == top)
        other = np.flatnonzero(pack_N != top)
        if not len(other):
            return
        diff_MO = weight_N[mine][:, None] - weight_N[other][None, :]  # load leaving the top pack
        new_top_MO = load_G[top] - diff_MO
        new_other_MO = load_G[pack_N[other]][None, :] + diff_MO
        worst_MO = np.maximum(new_top_MO, new_other_MO)
        legal_MO = (diff_MO > 0) & ~holds_GK[top][key_N[other]][None, :] \
            & ~holds_GK[pack_N[other]][:, key_N[mine]].T
        same_key_MO = key_N[mine][:, None] == key_N[other][None, :]
        legal_MO &= ~same_key_MO
        worst_MO = np.where(legal_MO, worst_MO, np.inf)
        a, b = np.unravel_index(np.argmin(worst_MO), worst_MO.shape)
        if not worst_MO[a, b] < load_G[top] - 1e-9 * max(load_G[top], 1.0):
            return
        i, j = mine[a], other[b]
        h = pack_N[j]
        pack_N[i], pack_N[j] = h, top
        load_G[top] -= diff_MO[a, b]
        load_G[h] += diff_MO[a, b]
        holds_GK[top, key_N[i]], holds_GK[h, key_N[j]] = False, False
        holds_GK[top, key_N[j]], holds_GK[h, key_N[i]] = True, True


def plan_eplb(load_LE: np.ndarray, num_gpus: int, num_redundant: int = 0, num_nodes: int = 1,
              num_groups: Optional[int] = None, refine: bool = True) -> Plan:
    """A placement of E experts + num_redundant replicas on num_gpus GPUs (num_nodes nodes), per layer.

    load_LE: rows routed to each expert (from a trace or the load statistics). Without replicas the
    planner still packs the experts so that the GPUs' loads are even.
    """
    load_LE = np.asarray(load_LE, dtype=np.float64)
    if load_LE.ndim != 2 or (load_LE < 0).any():
        raise ValueError(f"load must be a non-negative [layers, experts] array, got shape {load_LE.shape}")
    L, E = load_LE.shape
    P, G = E + num_redundant, num_groups or E
    if num_gpus <= 0 or num_nodes <= 0 or num_gpus % num_nodes:
        raise ValueError(f"num_gpus={num_gpus} must be a positive multiple of num_nodes={num_nodes}")
    if num_redundant < 0 or P % num_gpus:
        raise ValueError(f"experts + replicas = {E} + {num_redundant} = {P} must be a multiple of num_gpus={num_gpus}"
                         f" (every GPU holds the same number of slots)")
    if E % G or G % num_nodes:
        raise ValueError(f"num_groups={G} must divide num_experts={E} and be a multiple of num_nodes={num_nodes}")
    S, gpus_per_node = P // num_gpus, num_gpus // num_nodes
    experts_per_node = E // num_nodes
    if S > experts_per_node:
        raise ValueError(f"{S} slots per GPU but only {experts_per_node} experts per node: a GPU would hold an "
                         f"expert twice; use fewer replicas or fewer nodes")
    # 1. expert groups -> nodes
    group_load_LG = load_LE.reshape(L, G, E // G).sum(-1)
    phy2log_LP = np.empty((L, P), dtype=np.int64)
    for layer in range(L):
        node_of_group = balanced_packing(group_load_LG[layer], np.arange(G), num_nodes, refine)
        node_of_expert = np.repeat(node_of_group, E // G)
        for node in range(num_nodes):
            experts = np.flatnonzero(node_of_expert == node)
            # 2. replicas inside the node
            count = replicate(load_LE[layer, experts][None], P // num_nodes, gpus_per_node)[0]
            rep_expert = np.repeat(experts, count)
            rep_load = np.repeat(load_LE[layer, experts] / count, count)
            # 3. replicas -> the node's GPUs
            gpu = balanced_packing(rep_load, rep_expert, gpus_per_node, refine)
            for local in range(gpus_per_node):
                g = node * gpus_per_node + local
                phy2log_LP[layer, g * S:(g + 1) * S] = np.sort(rep_expert[gpu == local])
    return Plan(phy2log_LP, E, num_gpus, num_nodes)


def contiguous_plan(num_layers: int, num_experts: int, num_gpus: int) -> Plan:
    """The default EP layout (experts [g*E/N, (g+1)*E/N) on GPU g), as a Plan, for comparison."""
    if num_experts % num_gpus:
        raise ValueError(f"num_experts={num_experts} is not divisible by num_gpus={num_gpus}")
    return Plan(np.tile(np.arange(num_experts, dtype=np.int64), (num_layers, 1)), num_experts, num_gpus)


def plan_auto(load_LE: np.ndarray, num_gpus: int, num_redundant: int = 0, gpus_per_node: int = 8,
              hierarchical: bool = True) -> Plan:
    """The global plan, or the hierarchical one (nodes of gpus_per_node GPUs) where it applies and
    balances the planning load at least as well (its replicas stay inside a node)."""
    from moe_infer.lab.loads import imbalance

    best = plan_eplb(load_LE, num_gpus, num_redundant, 1)
    nodes = num_gpus // gpus_per_node
    E, S = load_LE.shape[1], (load_LE.shape[1] + num_redundant) // num_gpus
    if hierarchical and nodes > 1 and num_gpus % gpus_per_node == 0 and E % nodes == 0 and S <= E // nodes:
        hier = plan_eplb(load_LE, num_gpus, num_redundant, nodes)
        if imbalance(hier.gpu_load(load_LE)).mean() <= imbalance(best.gpu_load(load_LE)).mean() + 1e-12:
            best = hier
    return best
