"""Offload decisions replayed on CPU: the engine's stores on traced routing, with a modelled clock.

    python benchmarks/offload_replay.py                  # CPU, about a minute: the table below
    python benchmarks/offload_replay.py --streams 16 --sequences 1

What runs is the engine's own offload code (OffloadManager, OffloadedExpertStore.fetch / run / prefetch, the slot
tables, the cache policy, the prefetch rule, the cost model's miss split) over 32 Mixtral-shaped MoE layers with
tiny tensors (E=8, K=2), the GPU cache planned as on the H100 run (56 expert slots: 2 stream buffers, 22 layers with
2 slots, 10 with 1). Routing is the trained tiny model's, replayed as benchmarks/offload.py does (`TraceReplay`:
layer l is tiny layer l % 6, the pre-gate is the tiny router on the previous layer's input; the last row's
pre-gate knows the router's picks: what prediction alone could win). Bytes are counted in Mixtral experts (352 MB).

The clock is a model, not a measurement (`SimCopier`): one link that moves an expert in 352 MB / --link-gbps,
copies in issue order, each after the compute it must follow; the host spends --host-ms per layer (the eager layer
and its offload work) and --cpu-ms per expert it computes (rows out and back included); the GPU --gpu-ms per layer;
the host waits for the GPU at each layer's routing (the one sync). The defaults replay the H100 run's `all` rule
as measured there (docs/notes/offload.md). Step times from the model rank the rules; the GPU benchmark measures
them. Writes benchmarks/results/offload_replay_cpu_<streams>streams.json.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from e2e_generate import write_result  # noqa: E402
from offload_parts import TraceReplay, record_tiny_traces  # noqa: E402

from moe_infer.config import OffloadConfig  # noqa: E402
from moe_infer.offload import ExpertShape, OffloadedExpertStore, OffloadManager, plan_offload  # noqa: E402
from moe_infer.offload.copier import Copier  # noqa: E402
from moe_infer.offload.cost import CostModel  # noqa: E402

MIXTRAL_EXPERT_BYTES = 3 * 4096 * 14336 * 2
D, F = 8, 4  # tiny experts: the bookkeeping and the copies run, the bytes are scaled


class SimClock:
    def __init__(self) -> None:
        self.host = 0.0  # seconds: where the host thread is
        self.gpu = 0.0  # seconds: when the work queued on the compute stream ends


class SimCopier(Copier):
    """The link on the modelled clock: events are completion times in seconds."""

    def __init__(self, clock: SimClock, bytes_per_s: float) -> None:
        super().__init__(torch.device("cpu"))
        self.sim, self.clock, self.bytes_per_s = clock, (lambda: clock.host), bytes_per_s

    def copy(self, pairs, after=(), zeros=()):
        for dst in zeros:
            dst.zero_()
        for dst, src in pairs:
            dst.copy_(src)
        seconds = sum(src.numel() * src.element_size() for _, src in pairs) / self.bytes_per_s
        now = self._age()
        self.busy_s += seconds
        self.link_free_at = max([now, self.link_free_at] + [t for t in after if t is not None]) + seconds
        return self.link_free_at

    def wait(self, events) -> None:
        self.sim.gpu = max([self.sim.gpu] + [t for t in events if t is not None])

    def mark(self):
        return self.sim.gpu


class _Router:
    def __init__(self) -> None:
        self.out = None

    def __call__(self, x_TD):
        return None, self.out[1], self.out[0]


def build(cfg: OffloadConfig, args, clock: SimClock):
    L, E, K = 32, 8, 2
    shape = ExpertShape(L, E, K, D, F, torch.float32)
    cfg.gpu_expert_budget_gb = args.gpu_slots * shape.nbytes / 2**30
    m = OffloadManager(cfg, plan_offload(cfg, shape), torch.device("cpu"))
    routers = [_Router() for _ in range(L)]
    stores = [OffloadedExpertStore(E, D, F, torch.float32, manager=m, router=r) for r in routers]
    m.finish_load()
    scale = MIXTRAL_EXPERT_BYTES / shape.nbytes  # one tiny byte stands for `scale` Mixtral bytes
    cpu_s = args.cpu_ms / 1e3
    cpu_at = ((1, cpu_s), (4, cpu_s), (16, 1.2 * cpu_s), (64, 3 * cpu_s))  # seconds of an expert at n rows
    m.cost = CostModel(args.link_gbps * 1e9 / scale, cpu_at,
                       cpu13_seconds_at=tuple((n, args.cpu13_share * t) for n, t in cpu_at))
    m.cost.observe_cpu = lambda rows, seconds, **kw: None  # the host's CPU time is modelled, not measured here
    m.copier = SimCopier(clock, m.cost.h2d_bytes_per_s)
    return m, stores, routers


def replay(cfg: OffloadConfig, replay_: TraceReplay, seqs: List[int], args) -> Dict[str, float]:
    """Decode `args.steps` tokens of each group of `args.streams` sequences; stats after 2 warm-up steps."""
    totals: Dict[str, float] = {}
    step_s = []
    for first in seqs:
        clock = SimClock()
        m, stores, routers = build(cfg, args, clock)
        seq_T = torch.arange(first, first + args.streams)
        for step in range(args.steps + 2):
            if step == 2:
                m.reset_stats()
                t0 = clock.host
            pos_T = torch.full_like(seq_T, 16 + step)
            x_TD = torch.zeros(len(seq_T), D)
            for layer, store in enumerate(stores):
                clock.host += args.host_ms * 0.6e-3  # attention and router launched
                clock.gpu = max(clock.gpu, clock.host) + args.gpu_ms * 0.5e-3
                clock.host = max(clock.host, clock.gpu)  # the layer's sync
                if layer + 1 < len(stores):
                    routers[layer + 1].out = (replay_.at(replay_.pred, seq_T, pos_T, layer + 1),
                                              replay_.at(replay_.pred_w, seq_T, pos_T, layer + 1))
                ids_TK = replay_.at(replay_.ids, seq_T, pos_T, layer)
                fetched = store.fetch(x_TD, ids_TK)
                clock.host += args.host_ms * 0.4e-3  # the offload decisions

                def compute(x, slot_ids_TK, weights_TK, w13, w2):
                    clock.gpu = max(clock.gpu, clock.host) + args.gpu_ms * 0.5e-3
                    return torch.zeros_like(x)

                fetched.run(x_TD, ids_TK, torch.full(ids_TK.shape, 0.5), compute)
                if fetched.cpu_rows:  # the host computed them after queuing the GPU's work; the GPU adds them
                    clock.host += sum(m.cost.cpu_seconds(n) if f is None else f * m.cost.cpu13_seconds(n)
                                      for n, f in zip(fetched.cpu_rows, fetched.cpu_shares))
                    clock.gpu = max(clock.gpu, clock.host)
            clock.host = max(clock.host, clock.gpu)  # sampling reads the logits
        step_s.append((clock.host - t0) / args.steps)
        for k, v in m.summary()["total"].items():
            if isinstance(v, (int, float)) and k.isidentifier():
                totals[k] = totals.get(k, 0.0) + v
        calibration = m.summary()["prefetch_calibration"]
    steps = args.steps * len(seqs)
    gb = MIXTRAL_EXPERT_BYTES / 1e9
    needed = totals["needed"]
    return {"gb_per_step": totals["bytes_h2d"] / (D * F * 3 * 4) * gb / steps,
            "gb_misses_per_step": (totals["copied"] + totals["streamed"]) * gb / steps,
            "gb_wasted_per_step": totals["prefetch_wasted"] * gb / steps,
            "hit_rate": totals["hits"] / needed, "cpu_share": (totals["cpu"] + totals["cpu_shared"]) / needed,
            "partial_share": totals["partial"] / needed, "shared_share": totals["shared"] / needed,
            "prefetched_per_step": totals["prefetched"] / steps, "wasted_per_step": totals["prefetch_wasted"] / steps,
            "evicted_needed_per_step": totals["prefetch_evicted_needed"] / steps,
            "prefetch_token_recall": totals["token_matches"] / max(totals["token_slots"], 1),
            "step_ms": 1e3 * sum(step_s) / len(step_s), "calibration": calibration}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--sequences", type=int, default=4, help="groups of streams replayed (averaged)")
    ap.add_argument("--steps", type=int, default=100, help="decode steps per group, after 2 warm-up steps")
    ap.add_argument("--gpu-slots", type=int, default=56, help="GPU expert slots in all (the H100 run: 56)")
    ap.add_argument("--link-gbps", type=float, default=54.4)
    ap.add_argument("--cpu-ms", type=float, default=9.0,
                    help="one expert's CPU path in the engine (the H100 host: 5.6-6.0 ms alone; 9 replays its run)")
    ap.add_argument("--cpu13-share", type=float, default=0.57,
                    help="an expert's gate/up projections alone, of its whole time on the host (H100 host: 3.73 / 6.58 ms)")
    ap.add_argument("--host-ms", type=float, default=2.7, help="host time per eager offloaded layer")
    ap.add_argument("--gpu-ms", type=float, default=0.5, help="GPU time per layer at this batch")
    ap.add_argument("--min-probs", default="0,0.3,0.5,0.7", help="saving: prefetch_min_prob values to replay")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    traces = record_tiny_traces(16, 128, torch.device("cpu"))
    replay_ = TraceReplay(traces, 8, 2, "cpu")
    seqs = [i * args.streams % 16 for i in range(args.sequences)]
    oracle = copy.copy(replay_)  # a pre-gate that knows the router's picks: what prediction alone can win
    oracle.pred, oracle.pred_w = replay_.ids, torch.full(replay_.ids.shape, 1.0 / replay_.K)
    runs = [("no prefetch", dict(prefetch=False), replay_), ("all (before)", dict(prefetch_rule="all"), replay_)]
    runs += [(f"saving p>={p}", dict(prefetch_rule="saving", prefetch_min_prob=float(p)), replay_)
             for p in args.min_probs.split(",")]
    runs.append(("saving, oracle", dict(prefetch_rule="saving"), oracle))
    runs += [(f"{name}, share", dict(kw, miss_policy="share"), routing) for name, kw, routing in runs]
    rows = []
    print(f"{'rule':16} {'GB/step':>8} {'misses GB':>9} {'wasted GB':>9} {'hit':>5} {'CPU':>5} {'pref/step':>9} "
          f"{'wasted':>6} {'evicted needed':>14} {'model ms':>8} {'tok/s':>6}")
    for name, kw, routing in runs:
        r = replay(OffloadConfig(store="cpu", **kw), routing, seqs, args)
        r.update(rule=name, **kw)
        rows.append(r)
        print(f"{name:16} {r['gb_per_step']:8.2f} {r['gb_misses_per_step']:9.2f} {r['gb_wasted_per_step']:9.2f} "
              f"{r['hit_rate']:5.2f} {r['cpu_share']:5.2f} {r['prefetched_per_step']:9.1f} {r['wasted_per_step']:6.1f} "
              f"{r['evicted_needed_per_step']:14.1f} {r['step_ms']:8.0f} {args.streams * 1e3 / r['step_ms']:6.2f}", flush=True)
    print(f"calibration of `saving` on the trace (P needed by key): {rows[-2]['calibration']}")
    write_result({"benchmark": "offload_replay", "device": "cpu (modelled clock)", "args": vars(args), "rows": rows},
                 f"offload_replay_cpu_{args.streams}streams.json", os.path.join(args.out, ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
