"""Trial (measurement notes, CPU, about a minute): the hit rate of a layer's GPU expert cache under LRU, LFU
and the optimal policy (Belady: evict the expert needed again last), on the trained tiny model's routing folded
to Mixtral's 8 experts, top-2 (as benchmarks/offload.py's trace routing), one stream, per layer, 1-3 slots.

A naive loop over the trace, independent of moe_infer.offload: it asks whether any eviction policy could raise
one stream's hit rate at the slots a 24 GB budget leaves a Mixtral layer (1-2).

    python benchmarks/trials/offload_cache_policies.py [--streams 4] [--tokens 512]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from offload_parts import fold, record_tiny_traces  # noqa: E402


def hit_rate(steps, slots: int, policy: str) -> float:
    """steps: the set of experts each step needs. A needed expert counts a hit if cached before the step."""
    cache, last, freq, hits, total = [], {}, {}, 0, 0
    for t, need in enumerate(steps):
        hits += sum(1 for e in need if e in cache)
        total += len(need)
        for e in freq:
            freq[e] *= 0.95
        for e in need:
            freq[e] = freq.get(e, 0.0) + 1
            last[e] = t
        for e in need:
            if e in cache:
                continue
            if len(cache) < slots:
                cache.append(e)
                continue
            cand = [c for c in cache if c not in need]
            if not cand:
                continue
            if policy == "lru":
                victim = min(cand, key=lambda c: last[c])
            elif policy == "lfu":
                victim = min(cand, key=lambda c: (freq.get(c, 0.0), last[c]))
            else:  # optimal: the one needed again last (or never)
                def next_use(c):
                    return next((u for u in range(t + 1, len(steps)) if c in steps[u]), len(steps))
                victim = max(cand, key=next_use)
            cache[cache.index(victim)] = e
    return hits / max(total, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args()
    tr = record_tiny_traces(args.streams, args.tokens, torch.device("cpu"))
    S, N, L, _ = tr["ids"].shape
    ids = fold(tr["ids"].reshape(-1, 4), 8, 2).view(S, N, L, 2)
    print(f"tiny-model trace folded to E=8, top-2: {S} streams x {N} tokens x {L} layers; mean hit rate per layer")
    for slots in (1, 2, 3):
        row = []
        for policy in ("lru", "lfu", "optimal"):
            rates = [hit_rate([set(ids[s, n, layer].tolist()) for n in range(N)], slots, policy)
                     for s in range(S) for layer in range(L)]
            row.append(f"{policy} {sum(rates) / len(rates):.3f}")
        print(f"{slots} slot{'s' if slots > 1 else ' '}: " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()
