"""Async scheduling: the host schedules and launches step n+1 while the device runs step n.

`LLMEngine.step` stays schedule -> run -> postprocess. With async scheduling the `run` is
`AsyncStepExecutor.run(plan)`: it launches the plan (inputs, forward, LM head, sampling: queued on the
device, its sampled ids copied to pinned host memory behind an event) and only then waits for the step
launched by the previous call, which it returns; the engine postprocesses that one (stop checks,
detokenizing, finishing, freeing) while the device runs the new step. So one `step()` returns the
outputs of the step before it, and the host work of a step (schedule, prepare, postprocess, outputs)
overlaps the device work of the next, as in vLLM's v1 engine.

The plan of step n+1 is made before step n's tokens are known (moe_infer/engine/scheduler.py,
`lookahead`): a sequence in step n goes on with a placeholder input that the runner takes on the device
from step n's sampled ids (`ModelRunner.prepare`). Outputs equal those of the synchronous engine:
  - a sequence that step n stops (EOS, a stop token or string) was scheduled in n+1 as well: that extra
    token is discarded, and its blocks are freed only once step n+1 is collected (it writes them);
    one that step n finishes by length for sure is not scheduled again, and its seat (max_num_seqs) goes to a
    waiting request in step n+1 (its blocks stay held until step n is collected);
  - seeded sampling draws from each sequence's own generator once per token, as without lookahead.
    Unseeded random sampling draws from the engine's generator for the whole batch, so it depends on
    the batch's make-up (with or without async scheduling, as in vLLM) and is not reproduced draw for
    draw; greedy and seeded requests are.
The expert-load statistics (`get_expert_load`) count the discarded tokens' routing too.

Fallbacks. Chosen once for the engine (`async_scheduling_blocker`), the whole engine runs steps
synchronously (`LocalExecutor` / `MeshExecutor`) when:
  - `scheduler.async_scheduling=false`;
  - pipeline stages (parallel.pp > 1): they keep pp batches in flight their own way (under a mesh without them
    the driver schedules ahead as here: moe_infer/parallel/pipeline.py);
  - an offloading expert store (offload.store=cpu|nvme): each MoE layer decides its copies on the host
    from the step's routing and pins per step;
  - `routing.trace=true`: the trace records every token's routing, and must not hold discarded ones;
  - `speculative.method=mtp`: the MTP layer runs over every step's hidden states with the tokens that follow them
    known on the host, so every step is collected before the next is scheduled.
Chosen per step by the scheduler (an empty plan: this step only collects step n, and the next one is
scheduled with every token known, as without lookahead): when the free KV blocks cannot hold every
running sequence's next chunk (preempting must see step n's tokens and frees).
With n-gram or draft speculation the engine schedules ahead as here, and runs a verify step synchronously: it
drains first (collects the step in flight, an empty plan) so that the proposer sees every token, and collects the
verify step before the next one is scheduled (how many tokens it accepts decides the next positions); lookahead
resumes with the next plain step (moe_infer/engine/speculative/speculator.py says when a step verifies).
Penalties need each sequence's token history; the one token the host does not know yet (step n's) is
this step's input, and the sampler counts it from the input ids on the device.
"""
from __future__ import annotations

from typing import Any, Optional

from moe_infer.config import EngineConfig
from moe_infer.parallel.pipeline import Finished, LocalExecutor, StepFailed


def async_scheduling_blocker(cfg: EngineConfig, parallel: Any) -> Optional[str]:
    """Why this engine runs its steps synchronously; None when it schedules ahead (see the module docstring)."""
    if not cfg.scheduler.async_scheduling:
        return "scheduler.async_scheduling=false"
    if parallel.is_distributed and parallel.dims.pp > 1:
        return "pipeline stages (parallel.pp > 1) keep pp batches in flight their own way"
    if cfg.offload.store != "resident":
        return f"offload.store={cfg.offload.store} decides expert copies on the host per layer and step"
    if cfg.routing.trace:
        return "routing.trace=true (the trace must not record the discarded lookahead tokens)"
    if cfg.speculative.method == "mtp":
        return "speculative.method=mtp runs its layer over every step's hidden states and the tokens after them"
    return None


class AsyncStepExecutor(LocalExecutor):
    """One rank, one step in flight: `run(plan)` launches plan and returns the step launched before it."""

    def __init__(self, runner: Any) -> None:
        super().__init__(runner)
        self.in_flight = None  # the LaunchedStep not collected yet
        self.num_lookahead_steps = 0  # steps launched while the one before them was in flight

    def run(self, plan: Any) -> Optional[Finished]:
        """Launches plan (an empty one launches nothing), then waits for the step in flight and returns it
        (None when there was none). A launch that raises fails plan (`StepFailed`) and leaves the step in
        flight for the next call; a collect that raises fails the collected step."""
        try:
            launched = self.runner.launch(plan, self.in_flight)
        except Exception as err:  # noqa: BLE001 - the plan's requests fail, the engine goes on
            raise StepFailed(plan, err) from err
        if launched is not None and self.in_flight is not None:
            self.num_lookahead_steps += 1
        done, self.in_flight = self.in_flight, launched
        if done is None:
            return None
        try:
            tokens, logprobs = self.runner.collect(done)
        except Exception as err:  # noqa: BLE001
            raise StepFailed(done.plan, err) from err
        return done.plan, tokens, logprobs
