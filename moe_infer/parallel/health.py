"""Naming the rank behind a failed collective or transfer.

A collective that times out (gloo: `parallel.timeout_s`) or loses a peer raises on the ranks that
were waiting in it, but torch's message names neither the rank that never came nor why. So every
rank that sees such a failure marks itself in torchrun's rendezvous store (`failed/<rank>`) and
waits a moment (`GRACE_S`) for the other ranks of the group to do the same: a rank that did not is
the one that died or hangs outside the collective, and the error says so, naming it. The store is
only touched on failure, never on the step path. The resulting `MeshError` is not a request's
failure: the mesh cannot go on, so the engine raises it and every rank exits.
"""
from __future__ import annotations

import logging
import time
from typing import Optional, Sequence

import torch.distributed as dist

logger = logging.getLogger(__name__)

GRACE_S = 2.0  # how long a failing rank waits for its peers to report the same failure
_PREFIX = "moe_infer/failed/"
_PEER_GONE = ("Connection closed", "Connection reset", "Broken pipe", "closed by peer", "Socket closed")


class MeshError(RuntimeError):
    """A collective or transfer between the ranks failed: a peer died, hung past parallel.timeout_s, or
    runs a different program. Not recoverable by failing one step's requests."""


def _store() -> Optional[dist.Store]:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no default group (a single rank) or no store: nothing to ask
        return None


def absent_ranks(ranks: Sequence[int], my_rank: int, grace_s: float = GRACE_S) -> Optional[list]:
    """Mark my_rank as failed and return the ranks of `ranks` that did not mark themselves within grace_s
    (None when the store cannot be reached)."""
    store = _store()
    if store is None:
        return None
    try:
        store.set(f"{_PREFIX}{my_rank}", str(time.time()))
        pending = [r for r in ranks if r != my_rank]
        deadline = time.monotonic() + grace_s
        while pending:
            pending = [r for r in pending if not store.check([f"{_PREFIX}{r}"])]
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return pending
    except Exception:  # noqa: BLE001 - the store's host is gone too
        return None


def mesh_error(what: str, err: BaseException, ranks: Sequence[int], my_rank: int, timeout_s: float) -> MeshError:
    """The error to raise on `my_rank` when `what` (a collective over `ranks`, global ranks) failed with err."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    peer_gone = any(s in str(err) for s in _PEER_GONE)
    absent = absent_ranks(ranks, my_rank)
    if absent:
        who = ", ".join(str(r) for r in absent)
        cause = (f"rank {who} did not reach it ({'its connection closed: the process died' if peer_gone else f'hung or dead: nothing within parallel.timeout_s={timeout_s:g} s'})")
    elif absent is None:
        cause = "the rendezvous store cannot be reached to find which rank failed (the driver's host may be down)"
    else:
        cause = "every rank of the group reported a failure (the first error is on the rank that broke first)"
    msg = f"{what} failed on rank {my_rank} (ranks {list(ranks)}): {cause} [{text}]"
    logger.error(msg)
    return MeshError(msg)
