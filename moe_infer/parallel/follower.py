"""The step under a mesh, on every rank but the driver: `serve`, run inside `LLM.generate` until the driver's END.

Per step: the header (broadcast by the driver on the first stage, from the previous stage's rank of the same
in-stage index elsewhere: the step's one host message); the inputs over the device group, into the buffer of
the step's path (`runner.paths.receive`: the same bytes at the same place as on the driver, so the same CUDA
graphs read them; on the first stage the replayed graphs broadcast them themselves); on stages after the first the
previous stage's hidden states, into the graphs' buffer; then the same forward as the driver's (graphs replayed,
their collectives inside). A rank of the last stage computes the logits; the sampler (the first rank of the last
stage, when it is not the driver: pipeline stages) samples and sends the tokens back to the driver. A stage before
the last passes header, inputs and hidden states on. With async scheduling the input ids that the step before
sampled are filled in on the driver before the inputs leave: this rank's host never waits on its device.

Failures: a forward that raises on the first stage is logged and skipped (it raised on the driver too, which
fails the step's requests: `pipeline.StepFailed`); on a later stage it stops the mesh (the driver would otherwise
wait for that batch forever).
"""
from __future__ import annotations

import functools
import logging
from typing import Any, List

import torch
import torch.distributed as dist

from moe_infer.parallel.channel import StepChannel
from moe_infer.parallel.health import MeshError
from moe_infer.parallel.step_message import KIND_END, counts_of, pack_result

logger = logging.getLogger(__name__)


def serve(ctx: Any, runner: Any) -> List[Any]:
    """A rank other than the driver, inside `LLM.generate`: run the driver's steps until END; returns
    the driver's outputs."""
    channel = StepChannel(ctx)
    is_sampler = ctx.rank == ctx.sampler_rank
    first, last = ctx.is_first_stage, ctx.is_last_stage
    with torch.inference_mode():
        while True:
            msg = channel.broadcast_header(None) if first else channel.recv_header(ctx.prev_rank)
            if msg.kind == KIND_END:
                if not last:
                    channel.send_header(msg, ctx.next_rank)
                break
            reqs = None
            if is_sampler and ctx.dims.pp > 1:
                finished, reqs = runner.decoder.decode(msg)
                runner.sampler.forget(finished)
            sizes, path, num_extra, num_bytes = runner.message_layout(msg)
            if not first:
                fill = functools.partial(channel.recv_payload, src=ctx.prev_rank)
            else:  # the first stage: the driver's broadcast, inside the replayed graphs where they do it
                fill = None if runner.paths.broadcasts_inside(path) else channel.broadcast_payload
            try:
                inputs, _, payload = runner.paths.receive(path, sizes, num_extra, num_bytes, fill)
                hidden_in = None
                if not first:
                    hidden_in = runner.hidden_input(path, inputs)
                    channel.recv_hidden(hidden_in, ctx.prev_rank)
                if reqs is not None and runner.decoder.replica_samples:  # attention data parallelism
                    inputs = runner.with_replica_samples(inputs, runner.decoder.replica_samples)
                runner.before_forward(inputs, msg.flags)
                hidden_TD, logits_TV = runner.forward_step(inputs, hidden_in)
                sampled = runner.sample(inputs, hidden_TD, reqs, logits_TV) if last else None
            except MeshError:
                raise
            except Exception:  # noqa: BLE001
                if not first:  # the driver would wait for this batch forever: leave the mesh
                    raise
                logger.exception("rank %d: the forward of a step failed (the driver fails its requests)", ctx.rank)
                continue
            if not last:
                channel.send_header(msg, ctx.next_rank)
                channel.send_payload(payload, ctx.next_rank)  # after the forward: received by then
                channel.send_hidden(hidden_TD, ctx.next_rank)
            elif is_sampler and ctx.dims.pp > 1:
                out = sampled.result() if sampled is not None else None
                tokens, logprobs = (out.token_ids, out.logprobs) if out is not None else ([], [])
                channel.send_result(pack_result(tokens, logprobs, counts_of(reqs)))
            channel.retire(keep=3 * ctx.dims.pp)
    channel.retire()
    merge_stage_stats(ctx, runner)
    return ctx.broadcast_object(None)


def merge_stage_stats(ctx: Any, runner: Any) -> None:
    """Pipeline stages: every rank counts its own layers' expert load; after a generate each rank takes the
    other stages' counts (a sum over the world: other layers zeroed, every stage's ranks counted alike)."""
    stats = runner.stats
    if ctx.dims.pp == 1 or stats is None:
        return
    mine_L = torch.zeros(stats.num_layers, dtype=torch.bool)
    mine_L[list(runner.model.local_layers)] = True
    for counts_LE in (stats.routed_LE, stats.dropped_LE, stats.rerouted_LE):
        local_LE = counts_LE.cpu().masked_fill(~mine_L[:, None], 0)
        try:
            dist.all_reduce(local_LE, group=ctx.control_group)
        except RuntimeError as err:
            raise ctx.failure("merging the expert-load statistics", err) from err
        counts_LE.copy_(local_LE // ctx.dims.stage_size)
