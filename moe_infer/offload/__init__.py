"""Expert weight stores: where the experts live, and how they reach the GPU when they do not fit.

Design
------
Which experts stay on the GPU, and why. With `offload=resident` all of them: the right choice
whenever they fit. With `offload=cpu` or `nvme` the GPU holds, per MoE layer, a fixed number of
expert slots (the budget, `gpu_expert_budget_gb` or `slots_per_layer`, spread evenly over the
layers: a layer's slots only ever hold that layer's experts, so one layer's burst never flushes
another's hot set) plus two stream buffers shared by all layers. What fills a layer's slots is the
cache policy (`lru`, or `lfu`: the experts with the most routed rows in the recent load
statistics stay) under one rule: an expert the running step or an in-flight prefetch needs is
never evicted. Slots are to experts what KV blocks are to tokens: a pool, a table, a policy.

What moves, and when.
  start-up  every expert once from the checkpoint into the host tier: pinned host memory
            (`cpu`), or files on a local disk (`nvme`) behind a pinned host cache of
            `cpu_budget_gb` (three tiers, GPU <- CPU <- NVMe). Pinned memory is planned up front
            and never allocated per step. The cost model is measured (link, CPU, disk). Every
            tier, slot and copy holds an expert in the checkpoint's format (a quantized one: its
            data and scales, offload/layout.py); only the kernels and the host's compute read it.
  layer l   after routing, one host sync brings the rows per expert of layer l and the pre-gate
            of layer l+1 (layer l+1's router on layer l's hidden state). Hits run from their
            slots. Each miss goes where the cost model says it finishes first: over the link into
            a slot (the GPU waits on the copy's event, the host never blocks), or to the CPU
            (Fiddler-style: the rows go to the host, the expert runs on the host cores, the
            result comes back). A step that needs more than `stream_fraction` of a layer's
            experts (a large prefill, a wide batch) streams its misses through the two buffers,
            copy of chunk i+1 under compute of chunk i, instead of flushing the cache.
  after l   once the GPU has layer l's work queued, the side stream copies those of layer l+1's
            predicted experts that the prefetch rule accepts (prefetch.py: by default only where
            the expected saving beats the link time and the evicted expert's own chance) into its
            slots (pinned until layer l+1 has run), overlapping layer l's tail and layer l+1's
            attention.

Each layer step decides on the host which experts to move, so a decode step is not one CUDA graph:
each layer's attention part is replayed as its own graph and the MoE layers run eagerly between
them (engine/layer_graphs.py); prefill steps run eagerly. The resident store keeps whole-step graphs.

With expert parallelism each rank's stores hold its own experts (the dispatcher's local slots)
and cache them independently.
"""
from moe_infer.offload.manager import OffloadManager
from moe_infer.offload.fetched import FetchedExperts
from moe_infer.offload.offloaded import OffloadedExpertStore
from moe_infer.offload.plan import ExpertShape, OffloadPlan, plan_offload
from moe_infer.offload.policies import CACHE_POLICIES
from moe_infer.offload.store import EXPERT_STORES, ResidentExpertStore

EXPERT_STORES.register("cpu")(OffloadedExpertStore)
EXPERT_STORES.register("nvme")(OffloadedExpertStore)

__all__ = ["CACHE_POLICIES", "EXPERT_STORES", "ExpertShape", "FetchedExperts", "OffloadManager",
           "OffloadPlan", "OffloadedExpertStore", "ResidentExpertStore", "plan_offload"]
