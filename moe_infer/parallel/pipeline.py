"""The step under a mesh: the driver's executor and the other ranks' serve loop.

`LLMEngine.step` stays schedule -> run -> postprocess; `run` is an executor's `run(plan)`, which
returns a finished batch (plan, tokens, logprobs) or None while batches are still in flight.

    LocalExecutor   one rank: `runner.execute(plan)`, the batch finishes in the same step
    MeshExecutor    the driver (rank 0) under torchrun: encodes the plan as tensors, broadcasts it
                    over the first stage, runs its layers, and with pipeline stages sends the plan
                    and hidden states to the next stage and keeps up to pp batches in flight (the
                    scheduler skips their sequences), taking back the oldest batch's tokens from the
                    last stage when pp are out
    serve(...)      every other rank, inside `LLM.generate`: receives each step (broadcast on the
                    first stage, from the previous stage elsewhere), runs its layers, passes the
                    step on or, on the last stage, samples and returns the tokens; until END

A step whose forward raises on the first stage fails that plan's requests only (`StepFailed`; the
other ranks of the stage log it and go on). A failed collective or transfer is a `MeshError`: the
engine cannot go on and every rank exits, the error naming the rank at fault.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Any, Deque, List, Optional, Tuple

import torch
import torch.distributed as dist

from moe_infer.parallel.channel import StepChannel
from moe_infer.parallel.health import MeshError
from moe_infer.parallel.step_message import KIND_END, end_message

logger = logging.getLogger(__name__)

Finished = Tuple[Any, List[Optional[int]], List[Optional[tuple]]]  # (plan, tokens, logprobs) per plan entry


class StepFailed(Exception):
    """The forward of `plan` raised (not a mesh failure): its requests fail, the engine goes on."""

    def __init__(self, plan: Any, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.plan, self.cause = plan, cause


# ---- sampled tokens as one float64 tensor (ids are exact in float64) -------------------------------
def result_size(counts: List[Optional[int]]) -> int:
    """counts: logprobs requested per sampling sequence (None: none)."""
    return sum(1 if n is None else 3 + 2 * n for n in counts)


def pack_result(tokens: List[int], logprobs: List[Optional[tuple]], counts: List[Optional[int]]) -> torch.Tensor:
    values: List[float] = []
    for token, lp, n in zip(tokens, logprobs, counts):
        values.append(token)
        if n is not None:
            chosen, rank, top_ids, top_vals = lp
            values += [chosen, rank, *top_ids, *top_vals]
    return torch.tensor(values, dtype=torch.float64)


def unpack_result(buf: torch.Tensor, counts: List[Optional[int]]) -> Tuple[List[int], List[Optional[tuple]]]:
    values, at = buf.tolist(), 0
    tokens: List[int] = []
    logprobs: List[Optional[tuple]] = []
    for n in counts:
        tokens.append(int(values[at]))
        if n is None:
            logprobs.append(None)
            at += 1
            continue
        chosen, rank = values[at + 1], int(values[at + 2])
        top_ids = [int(v) for v in values[at + 3:at + 3 + n]]
        logprobs.append((chosen, rank, top_ids, values[at + 3 + n:at + 3 + 2 * n]))
        at += 3 + 2 * n
    return tokens, logprobs


def _counts(reqs) -> List[Optional[int]]:
    return [r.params.logprobs for r in reqs]


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
    """The driver under torchrun (see the module docstring)."""

    def __init__(self, ctx: Any, runner: Any) -> None:
        super().__init__(runner)
        self.ctx, self.depth = ctx, ctx.dims.pp
        self.channel = StepChannel(ctx, runner.arch.hidden_size, runner.dtype)
        self.in_flight: Deque[tuple] = deque()  # (plan, result work, result buffer, logprob counts)

    def run(self, plan: Any) -> Optional[Finished]:
        ctx, runner = self.ctx, self.runner
        if self.depth == 1:
            runner.sampler.forget(plan.finished_seq_ids)
        if plan.is_empty:
            runner.encoder.note_finished(plan.finished_seq_ids)
            return self._collect() if self.in_flight else None
        msg = runner.encode(plan)
        try:
            if ctx.dims.stage_size > 1:
                self.channel.broadcast(msg)
            hidden_TD, inputs = runner.run_stage(msg, None)
            if self.depth == 1:
                out = runner.sample_step(inputs, hidden_TD, runner.plan_requests(plan))
        except MeshError:
            raise
        except Exception as err:  # noqa: BLE001 - deterministic on every rank of the stage: they skip it too
            raise StepFailed(plan, err) from err
        if self.depth == 1:
            return (plan, *runner.per_plan_entry(plan, out.token_ids if out else [], out.logprobs if out else []))
        self.channel.send(msg, ctx.next_rank)
        self.channel.send_hidden(hidden_TD, ctx.next_rank)
        counts = _counts(runner.plan_requests(plan))
        self.in_flight.append((plan, *self.channel.post_result_recv(result_size(counts)), counts))
        self.channel.retire(keep=self.depth)
        return self._collect() if len(self.in_flight) >= self.depth else None

    def _collect(self) -> Finished:
        plan, work, buf, counts = self.in_flight.popleft()
        self.channel.wait_result(work)
        return (plan, *self.runner.per_plan_entry(plan, *unpack_result(buf, counts)))

    def finish(self, outputs: List[Any]) -> List[Any]:
        """End of a generate: drain the batches still in flight (their requests were aborted), send END
        down the stages, merge the expert-load statistics of the stages, hand every rank the outputs."""
        while self.in_flight:
            self._collect()
        end = end_message()
        if self.ctx.dims.stage_size > 1:
            self.channel.broadcast(end)
        if self.depth > 1:
            self.channel.send(end, self.ctx.next_rank)
        self.channel.retire()
        merge_stage_stats(self.ctx, self.runner)
        return self.ctx.broadcast_object(outputs)


def serve(ctx: Any, runner: Any) -> List[Any]:
    """A rank other than the driver, inside `LLM.generate`: run the driver's steps until END; returns
    the driver's outputs."""
    channel = StepChannel(ctx, runner.arch.hidden_size, runner.dtype)
    is_sampler = ctx.rank == ctx.sampler_rank
    while True:
        msg = channel.broadcast(None) if ctx.is_first_stage else channel.recv(ctx.prev_rank)
        if msg.kind == KIND_END:
            if not ctx.is_last_stage:
                channel.send(msg, ctx.next_rank)
            break
        reqs = None
        if is_sampler:
            finished, reqs = runner.decoder.decode(msg)
            runner.sampler.forget(finished)
        hidden_in = None if ctx.is_first_stage else channel.recv_hidden(ctx.prev_rank, msg.num_tokens)
        try:
            hidden_TD, inputs = runner.run_stage(msg, hidden_in)
            out = runner.sample_step(inputs, hidden_TD, reqs) if ctx.is_last_stage else None
        except MeshError:
            raise
        except Exception:  # noqa: BLE001
            if not ctx.is_first_stage:  # the driver would wait for this batch forever: leave the mesh
                raise
            logger.exception("rank %d: the forward of a step failed (the driver fails its requests)", ctx.rank)
            continue
        if not ctx.is_last_stage:
            channel.send(msg, ctx.next_rank)
            channel.send_hidden(hidden_TD, ctx.next_rank)
        elif is_sampler and ctx.dims.pp > 1:
            tokens, logprobs = (out.token_ids, out.logprobs) if out is not None else ([], [])
            channel.send_result(pack_result(tokens, logprobs, _counts(reqs)))
        channel.retire(keep=ctx.dims.pp)
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
