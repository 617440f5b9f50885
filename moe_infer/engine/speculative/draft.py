"""The draft-model proposer: a small model of the same vocabulary proposes k tokens, one forward a token.

The draft runs through the engine's own model code (a second ModelRunner: its graphs, kernels and attention
backends). Its paged KV cache has as many blocks as the target's and lives under the same block ids: a sequence's
block table holds both models' KV, so the target's block manager allocates, shares (prefix cache), rolls back and
frees the draft's KV too. `Sequence.num_draft_computed` counts the sequence's tokens whose draft KV is written (0
after a free or preemption; a prefix-cache hit is recomputed by the draft, whose own KV in those blocks another
sequence may not have written).

A proposal step (before the scheduler plans the verify step): the sequences' tokens the draft has not seen, up to
their last one, in one forward (its prompt, the first time: in chunks of the engine's token budget where longer),
which gives the first proposal; then k - 1 one-token forwards. The blocks for the proposals' KV are taken here (the
verify step needs them too); a sequence that does not get them proposes nothing. Greedy requests take the draft's
argmax (q one-hot); the others draw from the draft's distribution with the request's temperature and filters, q kept
for the rejection test. A seeded request's draws come from a generator of its own, apart from the target's (the two
streams must not be the same).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Dict, List, Optional, Tuple

import torch

from moe_infer.config import EngineConfig, SpeculativeConfig
from moe_infer.engine.sampler import SampleRequest
from moe_infer.engine.sequence import ScheduledSeq, SchedulerOutput, Sequence

logger = logging.getLogger(__name__)

DRAFT_SEED_OFFSET = 0x5DEECE66D  # a seeded request's draft draws: seed + this (its target draws: seed)


def draft_reserve(draft_path: str, cfg: EngineConfig, dtype: torch.dtype) -> Tuple[int, int]:
    """(bytes of a KV block of the draft's cache, bytes of its weights): what the target's KV budget leaves it."""
    from moe_infer.models.hf_config import load_arch

    arch, _ = load_arch(draft_path)
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_block = arch.num_layers * (1 if arch.mla is not None else 2) * arch.num_kv_heads * arch.head_dim \
        * cfg.cache.block_size * itemsize
    weights = sum(os.path.getsize(os.path.join(draft_path, f)) for f in os.listdir(draft_path)
                  if f.endswith(".safetensors"))
    return per_block, weights


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class DraftProposer:
    def __init__(self, cfg: SpeculativeConfig, engine_cfg: EngineConfig, target, block_manager, **_) -> None:
        from moe_infer.engine.model_runner import ModelRunner
        from moe_infer.models.hf_config import load_arch

        path = cfg.draft_model
        if not os.path.isdir(path):
            raise ValueError(f"speculative.draft_model={path!r} is not a checkpoint folder")
        arch, _ = load_arch(path)
        if arch.vocab_size != target.arch.vocab_size:
            raise ValueError(f"speculative.draft_model has a vocabulary of {arch.vocab_size} tokens and the target "
                             f"{target.arch.vocab_size}: a draft model must share the target's tokenizer and "
                             f"vocabulary")
        draft_cfg = dataclasses.replace(
            engine_cfg, model=dataclasses.replace(engine_cfg.model, path=path, load_format=cfg.draft_load_format,
                                                  max_model_len=None),
            cache=dataclasses.replace(engine_cfg.cache, num_kv_blocks=target.num_kv_blocks),
            speculative=SpeculativeConfig())
        self.runner = ModelRunner(draft_cfg, path, target.device, target.dtype, parallel=target.parallel)
        self.block_manager = block_manager
        self.max_model_len = self.runner.max_model_len
        self.max_num_batched_tokens = engine_cfg.scheduler.max_num_batched_tokens
        # a proposal's cost relative to a target step (adaptive k): decoding reads the weights, so their bytes
        self.proposal_cost = max(0.1, _weight_bytes(self.runner.model) / max(_weight_bytes(target.model), 1))
        self.generator = torch.Generator(device=target.device).manual_seed(engine_cfg.seed + DRAFT_SEED_OFFSET)
        self._seeded: Dict[int, torch.Generator] = {}
        logger.info("speculative decoding: draft model %s (%d layers), its KV cache under the target's %d blocks",
                    path, arch.num_layers, target.num_kv_blocks)

    def max_tokens(self, seq: Sequence) -> Optional[int]:
        """The most proposals seq can take: the draft writes KV at positions up to len(seq) + k - 2."""
        return self.max_model_len - len(seq) + 1

    @torch.inference_mode()
    def propose(self, seqs: List[Sequence], num_tokens: List[int]) -> None:
        bm = self.block_manager
        live: List[Tuple[Sequence, int]] = []
        for seq, k in zip(seqs, num_tokens):
            seq.spec_token_ids, seq.spec_probs = [], None
            L = len(seq)
            while k > 0 and not bm.can_append(seq, L + k - 1):
                k -= 1
            if k > 0:
                bm.append(seq, L + k - 1)
                live.append((seq, k))
        if not live:
            return
        probs: Dict[int, List[torch.Tensor]] = {seq.seq_id: [] for seq, _ in live}
        # the first forward: every token the draft has not seen, up to the last
        starts = [min(seq.num_draft_computed, len(seq) - 1) for seq, _ in live]  # the last token at least
        self._catch_up(live, starts)
        items = [self._item(seq, seq.token_ids[at:], at) for (seq, _), at in zip(live, starts)]
        tokens = self._step(items, [seq for seq, _ in live], 0, probs)
        for seq, _ in live:
            seq.num_draft_computed = len(seq)
        for (seq, _), t in zip(live, tokens):
            seq.spec_token_ids = [t]
        for j in range(1, max(k for _, k in live)):
            go = [(seq, k) for seq, k in live if k > j]
            items = [self._item(seq, seq.spec_token_ids[-1:], len(seq) + j - 1) for seq, _ in go]
            for (seq, _), t in zip(go, self._step(items, [seq for seq, _ in go], j, probs)):
                seq.spec_token_ids.append(t)
        for seq, _ in live:
            if probs[seq.seq_id]:
                seq.spec_probs = torch.stack(probs[seq.seq_id])

    def _catch_up(self, live: List[Tuple[Sequence, int]], starts: List[int]) -> None:
        """Draft KV of long unseen spans (a prompt) in chunks of the engine's token budget, without sampling, until
        every sequence's rest fits one forward (starts advanced in place)."""
        budget = self.max_num_batched_tokens
        while True:
            items, used = [], 0
            for i, (seq, _) in enumerate(live):
                rest = len(seq) - starts[i]
                if rest > budget and used < budget:
                    n = min(rest - 1, budget - used)
                    items.append(self._item(seq, seq.token_ids[starts[i]:starts[i] + n], starts[i], sample=False))
                    starts[i] += n
                    used += n
            if not items:
                return
            r = self.runner
            inputs = r.prepare(SchedulerOutput(seqs=items))
            r.before_forward(inputs)
            r.forward_step(inputs)

    def forget(self, seq_ids) -> None:
        """Finished sequences: their generators go."""
        for seq_id in seq_ids:
            self._seeded.pop(seq_id, None)

    @staticmethod
    def _item(seq: Sequence, token_ids, start: int, sample: bool = True) -> ScheduledSeq:
        return ScheduledSeq(seq_id=seq.seq_id, token_ids=list(token_ids), start_pos=start,
                            block_table=list(seq.block_table), do_sample=sample, params=seq.params if sample else None,
                            num_prompt_tokens=seq.num_prompt_tokens)

    def _step(self, items: List[ScheduledSeq], seqs: List[Sequence], j: int,
              probs: Dict[int, List[torch.Tensor]]) -> List[int]:
        """One draft forward -> each sequence's next proposal (q appended to probs for the sampled ones)."""
        r = self.runner
        inputs = r.prepare(SchedulerOutput(seqs=items))
        r.before_forward(inputs)
        hidden_TD, logits_TV = r.forward_step(inputs)
        logits_SV = r.sample_logits(inputs, hidden_TD, logits_TV)
        greedy = [seq.params.is_greedy for seq in seqs]
        if all(greedy):
            return logits_SV.argmax(-1).tolist()
        reqs = [SampleRequest(seq.seq_id, seq.params, seq.num_prompt_tokens, seq.num_output_tokens + j)
                for seq in seqs]
        q_SV = r.sampler.target_probs(logits_SV, reqs)
        expo_SV = torch.empty_like(q_SV).exponential_(generator=self.generator)
        for i, seq in enumerate(seqs):
            if seq.params.seed is not None and not greedy[i]:
                gen = self._seeded.get(seq.seq_id)
                if gen is None:
                    gen = self._seeded[seq.seq_id] = torch.Generator(device=q_SV.device).manual_seed(
                        seq.params.seed + DRAFT_SEED_OFFSET)
                expo_SV[i].exponential_(generator=gen)
        tokens = (q_SV / expo_SV).argmax(-1).tolist()
        for i, seq in enumerate(seqs):
            if not greedy[i]:
                probs[seq.seq_id].append(q_SV[i])
        return tokens
