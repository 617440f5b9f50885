"""Expert weight stores.

Design: an MoE layer never owns its expert weights directly; it asks an `ExpertStore` for the
stacked tensors of its local experts (`w13_E2FD`, `w2_EDF`) right before the expert compute. The
`resident` store keeps every local expert on the compute device for the life of the engine: the
right choice whenever the experts fit, and the only one built so far. A paging store (CPU/NVMe
with prefetch driven by the next layer's predicted experts) plugs in behind the same call.
"""
from moe_infer.offload.store import EXPERT_STORES, ResidentExpertStore

__all__ = ["EXPERT_STORES", "ResidentExpertStore"]
