"""The step under a mesh, on the driver: its executor (the other ranks' loop is `follower.serve`).

`LLMEngine.step` stays schedule -> run -> postprocess; `run` is an executor's `run(plan)`, which
returns a finished batch (plan, tokens, logprobs) or None while batches are still in flight.

    LocalExecutor   one rank: `runner.execute(plan)`, the batch finishes in the same step
    MeshExecutor    the driver (rank 0) under torchrun. A step: lay the plan out in the device buffer of its
                    path (the decode graphs', the prefill graphs' or a flat one: moe_infer/engine/step_paths.py)
                    with one host-to-device copy; send the header to the first stage (gloo: the step's one host
                    message) and the laid-out bytes over the device group (NCCL), into the same buffer of every
                    rank; replay the same graphs as every rank of the stage (their collectives inside); sample.
                    Without pipeline stages and with async scheduling (`lookahead`) it launches step n+1 before it
                    waits for step n's tokens, as the one-rank AsyncStepExecutor does: step n+1's input ids take
                    step n's sampled ids on the driver's device before the inputs leave, so they reach the other
                    ranks with them and no rank's host waits on its device. With pipeline stages it sends the
                    header, the inputs and its hidden states to the next stage and keeps up to pp batches in flight
                    (the scheduler skips their sequences), taking back the oldest batch's tokens from the last
                    stage when pp are out.

What crosses between the ranks per step, and its size (T tokens, B sequences, M blocks per sequence, D hidden):
the header, 8.4 KB on the host (13 ints, the sampler's host ints when the sampler is another rank), sent without
waiting for it; the inputs, about 25 bytes a token + 8 a sequence + 4 a block-table entry, padding included (a
decode step at batch 64 with 4k-token tables: ~70 KB), broadcast by the replayed graphs themselves on the first
stage (a step run eagerly broadcasts them before its forward); with pipeline stages the inputs and the hidden
states, T x D values, per stage boundary. The layers' collectives (TP all-reduces, EP reductions) are inside the
graphs. Under attention data parallelism (parallel.dp_attention) the inputs are one segment per replica, each padded
to the same sizes (dp x the bytes; moe_infer/engine/dp_inputs.py), and the sampling rows' hidden states (S x D a
replica) are all-gathered over the replicas for replica 0's LM head and the driver's sampler.

A step whose forward raises on the first stage fails that plan's requests only (`StepFailed`; the
other ranks of the stage log it and go on). A failed collective or transfer is a `MeshError`: the
engine cannot go on and every rank exits, the error naming the rank at fault.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Any, Deque, List, Optional, Tuple

import torch

from moe_infer.parallel.channel import StepChannel
from moe_infer.parallel.follower import merge_stage_stats
from moe_infer.parallel.health import MeshError
from moe_infer.parallel.step_message import counts_of, end_message, result_size, unpack_result

logger = logging.getLogger(__name__)

Finished = Tuple[Any, List[Optional[int]], List[Optional[tuple]]]  # (plan, tokens, logprobs) per plan entry


class StepFailed(Exception):
    """The forward of `plan` raised (not a mesh failure): its requests fail, the engine goes on."""

    def __init__(self, plan: Any, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.plan, self.cause = plan, cause


class LocalExecutor:
    """One rank: the batch runs and finishes in the same step."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def run(self, plan: Any) -> Optional[Finished]:
        if plan.is_empty:
            self.runner.sampler.forget(plan.finished_seq_ids)
            return None
        try:
            tokens, logprobs = self.runner.execute(plan)
        except MeshError:
            raise
        except Exception as err:  # noqa: BLE001 - the step's requests fail, the engine goes on
            raise StepFailed(plan, err) from err
        return plan, tokens, logprobs

    def finish(self, outputs: List[Any]) -> List[Any]:
        return outputs


class MeshExecutor(LocalExecutor):
    """The driver under torchrun (see the module docstring). lookahead: async scheduling (pp = 1 only)."""

    def __init__(self, ctx: Any, runner: Any, lookahead: bool = False) -> None:
        super().__init__(runner)
        if lookahead and ctx.dims.pp > 1:
            raise ValueError("async scheduling under a mesh needs pp = 1 (pipeline stages keep pp batches in flight)")
        self.ctx, self.depth, self.lookahead = ctx, ctx.dims.pp, lookahead
        self.channel = StepChannel(ctx)
        # pp > 1: (plan, result work, result buffer, logprob counts); lookahead: the launched step not collected yet
        self.in_flight: Deque[Any] = deque()

    def run(self, plan: Any) -> Optional[Finished]:
        runner = self.runner
        if self.depth == 1:
            runner.sampler.forget(plan.finished_seq_ids)
        if plan.is_empty:
            if self.ctx.sampler_rank != self.ctx.rank:  # that rank forgets them with the next step
                runner.encoder.note_finished(plan.finished_seq_ids)
            return self._collect() if self.in_flight else None
        prev = self.in_flight[-1] if self.lookahead and self.in_flight else None
        try:
            step = self._launch(plan, prev)
        except MeshError:
            raise
        except Exception as err:  # noqa: BLE001 - deterministic on every rank of the stage: they skip it too
            raise StepFailed(plan, err) from err
        self.in_flight.append(step)
        self.channel.retire(keep=3 * self.depth)  # the sends of the last steps may still run; older ones are through
        if self.depth > 1:
            return self._collect() if len(self.in_flight) >= self.depth else None
        return self._collect() if len(self.in_flight) > int(self.lookahead) else None

    @torch.inference_mode()
    def _launch(self, plan: Any, prev: Any) -> Any:
        ctx, runner, channel = self.ctx, self.runner, self.channel
        flat, sizes, num_extra = runner.lay_out(plan, prev)
        path = runner.paths.choose(sizes)
        inputs, extra_X, payload = runner.paths.load(path, flat, sizes, num_extra)
        if num_extra:  # before the inputs leave: the other ranks get the ids of the step in flight with them
            runner.fill_placeholders(inputs, extra_X, prev.sampled.token_ids_B)
        msg = None
        if ctx.dims.world_size > 1:  # a mesh of one rank (parallel.force_mesh) has nobody to tell
            msg = runner.encoder.encode(plan, sizes, path, num_extra, payload.numel(),
                                        for_sampler=ctx.sampler_rank != ctx.rank)
            channel.broadcast_header(msg)
        if not runner.paths.broadcasts_inside(path):  # else the replayed graphs broadcast them first
            channel.broadcast_payload(payload)
        runner.before_forward(inputs)
        hidden_TD, logits_TV = runner.forward_step(inputs)
        if self.depth == 1:
            return runner.launched(plan, runner.sample(inputs, hidden_TD, runner.plan_requests(plan), logits_TV))
        channel.send_header(msg, ctx.next_rank)
        channel.send_payload(payload, ctx.next_rank)
        channel.send_hidden(hidden_TD, ctx.next_rank)
        counts = counts_of(runner.plan_requests(plan))
        return (plan, *channel.post_result_recv(result_size(counts)), counts)

    def _collect(self) -> Finished:
        """The oldest step in flight, waited for."""
        if self.depth == 1:
            step = self.in_flight.popleft()
            try:
                return (step.plan, *self.runner.collect(step))
            except Exception as err:  # noqa: BLE001
                raise StepFailed(step.plan, err) from err
        plan, work, buf, counts = self.in_flight.popleft()
        self.channel.wait_result(work)
        return (plan, *self.runner.per_plan_entry(plan, *unpack_result(buf, counts)))

    def finish(self, outputs: List[Any]) -> List[Any]:
        """End of a generate: drain the batches still in flight (their requests were aborted), send END
        down the stages, merge the expert-load statistics of the stages, hand every rank the outputs."""
        while self.in_flight:
            self._collect()
        end = end_message()
        if self.ctx.dims.world_size > 1:
            self.channel.broadcast_header(end)
        if self.depth > 1:
            self.channel.send_header(end, self.ctx.next_rank)
        self.channel.retire()
        merge_stage_stats(self.ctx, self.runner)
        return self.ctx.broadcast_object(outputs)
