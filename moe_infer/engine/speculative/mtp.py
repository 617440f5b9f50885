"""The MTP proposer: DeepSeek-V3's multi-token-prediction layer (moe_infer/models/mtp.py) proposes k tokens from the
target's own hidden states.

The target is loaded with its MTP layer (`load_model(..., mtp=True)`: `model.mtp[0]`). The layer has a KV cache of
its own, with as many blocks as the target's under the same block ids (like a draft model's, draft.py): the target's
block manager allocates, shares, rolls back and frees it too.

After every target step (`observe`, called before the next proposals), each sequence of that step whose rows the
target computed runs through the layer: for a row at position i with the target's final hidden state h_i and the
token t_{i+1} that now follows it (the next prompt token, an accepted proposal or the sampled token), the layer writes
its KV at position i and predicts t_{i+2}. Rows of rejected proposals are left out (their positions are written again
by the next step's rows). The prediction at a sequence's last computed position (len - 2) is its first proposal.
For k > 1 the layer is chained on its own output, as vLLM and SGLang do: the proposal d_j at position len - 2 + j with
the layer's hidden state of the row before in place of the target's -> d_{j+1} (those KV rows are overwritten once the
target's hidden states for the positions arrive). Proposals are the layer's argmax (deterministic, q one-hot).

The target's hidden states come from its step (`ModelRunner.last_hidden`: with the MTP layer the decode graphs leave
the LM head out, so that a graph's output is the hidden states). The layer runs eagerly. A sequence whose last
step's hidden states were not observed (its KV from a prefix-cache hit, or a step skipped) proposes nothing until its
next step.

Legend: R rows through the layer, D hidden, V vocabulary.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

import torch

from moe_infer.engine.sequence import ScheduledSeq, SchedulerOutput, Sequence
from moe_infer.engine.step_inputs import decode_inputs, flat_inputs
from moe_infer.layers.forward_context import forward_context

logger = logging.getLogger(__name__)


def mtp_kv_bytes_per_block(model_path: str, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of a KV block of the MTP layer's cache (one MLA layer's latent rows): what the target's KV budget
    leaves it."""
    from moe_infer.models.hf_config import load_arch

    arch, _ = load_arch(model_path)
    if arch.mla is None:
        return 0  # refused when the model loads (build_mtp_layers)
    return arch.mla.cache_dim * block_size * torch.empty((), dtype=dtype).element_size()


class MTPProposer:
    def __init__(self, cfg, engine_cfg, target, block_manager, **_) -> None:
        mtp = getattr(target.model, "mtp", None)
        if not mtp:
            raise ValueError("speculative.method=mtp: the model has no multi-token-prediction layer loaded "
                             "(a DeepSeek-V3 checkpoint with num_nextn_predict_layers >= 1)")
        self.layer = mtp[0]
        self.target, self.block_manager = target, block_manager
        self.block_size = engine_cfg.cache.block_size
        self.layer.bind_kv_cache(self.layer.allocate_kv_cache(target.num_kv_blocks, self.block_size, target.device))
        self.proposal_cost = 0.1  # adaptive k's prior only (cost.py): one layer of the target's, eagerly
        self.can_fill = True  # deterministic proposals: a short one may be filled up to k (speculator.py)
        # per sequence: (position of its last observed row, the layer's hidden state there [D], its argmax)
        self._last: Dict[int, Tuple[int, torch.Tensor, int]] = {}
        logger.info("speculative decoding: the checkpoint's MTP layer proposes, its KV cache under the target's %d "
                    "blocks", target.num_kv_blocks)

    def max_tokens(self, seq: Sequence) -> Optional[int]:
        return None

    def forget(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self._last.pop(seq_id, None)

    # ------------------------------------------------------------------ after a target step
    @torch.inference_mode()
    def observe(self, running: List[Sequence]) -> None:
        """The target's last step through the layer (module docstring): every row whose next token is known."""
        step = self.target.last_hidden
        self.target.last_hidden = None
        if step is None:
            return
        plan, hidden_TD = step
        if hidden_TD is None or hidden_TD.shape[0] != sum(len(item.token_ids) for item in plan.seqs):
            return  # not every row's hidden state (cannot happen with speculation: no last-row pruning)
        by_id = {s.seq_id: s for s in running}
        items, rows = [], []
        at = 0
        for item in plan.seqs:
            n = len(item.token_ids)
            seq = by_id.get(item.seq_id)
            if seq is not None:
                m = min(n, len(seq) - 1 - item.start_pos)  # rows whose next token is known
                if m > 0 and item.start_pos + m <= len(seq) - 1:
                    nxt = seq.token_ids[item.start_pos + 1:item.start_pos + 1 + m]
                    items.append(self._item(seq, nxt, item.start_pos))
                    rows.extend(range(at, at + m))
            at += n
        if not items:
            return
        index_R = torch.tensor(rows, dtype=torch.int64).to(hidden_TD.device, non_blocking=True)
        y_RD, argmax_R = self._predict(items, hidden_TD.index_select(0, index_R))
        ends, total = [], 0
        for it in items:
            total += len(it.token_ids)
            ends.append(total - 1)
        for it, end in zip(items, ends):  # the proposal stays on the device: read with the others (`propose`)
            self._last[it.seq_id] = (it.start_pos + len(it.token_ids) - 1, y_RD[end], argmax_R[end])

    def _item(self, seq: Sequence, token_ids, start: int) -> ScheduledSeq:
        return ScheduledSeq(seq_id=seq.seq_id, token_ids=list(token_ids), start_pos=start,
                            block_table=list(seq.block_table), do_sample=False, params=None,
                            num_prompt_tokens=seq.num_prompt_tokens)

    def _predict(self, items: List[ScheduledSeq], hidden_RD: torch.Tensor,
                 ids_R: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """The layer over the items' rows (their KV written) -> (its hidden states [R, D], argmax tokens [R]).
        ids_R: the rows' input tokens on the device (then the items' own token ids are placeholders)."""
        flat, sizes = flat_inputs(SchedulerOutput(seqs=items), self.block_size)
        inputs = decode_inputs(torch.from_numpy(flat).to(hidden_RD.device, non_blocking=True), sizes,
                               self.block_size)
        if ids_R is not None:
            inputs.input_ids_T.copy_(ids_R)
        with forward_context(inputs.meta):
            y_RD = self.layer.predict(inputs.input_ids_T, inputs.meta.positions_T, hidden_RD)
        return y_RD, self.layer.compute_logits(y_RD).argmax(-1)

    # ------------------------------------------------------------------ before the schedule
    @torch.inference_mode()
    def propose(self, seqs: List[Sequence], num_tokens: List[int]) -> None:
        """Each sequence's k proposals: the observed first one, then the chained ones, kept on the device and read
        in one host copy at the end (one sync a step, whatever k)."""
        bm = self.block_manager
        live: List[Tuple[Sequence, int]] = []
        for seq, k in zip(seqs, num_tokens):
            seq.spec_token_ids, seq.spec_probs = [], None
            last = self._last.get(seq.seq_id)
            if last is None or last[0] != len(seq) - 2:  # its last step not observed
                continue
            L = len(seq)
            while k > 1 and not bm.can_append(seq, L + k - 1):  # the chained rows' KV: positions up to L + k - 3
                k -= 1
            if k > 1:
                bm.append(seq, L + k - 1)
            live.append((seq, k))
        if not live:
            return
        tokens = {seq.seq_id: [self._last[seq.seq_id][2]] for seq, _ in live}  # device scalars
        prev = {seq.seq_id: self._last[seq.seq_id][1] for seq, _ in live}  # the hidden state a chained row reads
        for j in range(1, max(k for _, k in live)):
            go = [seq for seq, k in live if k > j]
            items = [self._item(seq, [0], len(seq) - 2 + j) for seq in go]  # token: ids_R
            y_RD, argmax_R = self._predict(items, torch.stack([prev[seq.seq_id] for seq in go]),
                                           torch.stack([tokens[seq.seq_id][-1] for seq in go]))
            for i, seq in enumerate(go):
                tokens[seq.seq_id].append(argmax_R[i])
                prev[seq.seq_id] = y_RD[i]
        flat = torch.cat([torch.stack(tokens[seq.seq_id]) for seq, _ in live]).tolist()  # the step's one sync
        at = 0
        for seq, k in live:
            seq.spec_token_ids = flat[at:at + k]
            at += k
