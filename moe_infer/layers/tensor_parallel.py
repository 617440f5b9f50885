"""Tensor-parallel building blocks: a process-group handle and the sharded linears (Megatron style).

A layer is handed the `ShardGroup` it splits over (the mesh's "tp" or "moe_tp" axis); it never
looks up a global group. With size 1 every piece is the plain single-rank op (no collective, no
extra launch), so tp = 1 runs exactly the code it ran before. `all_reduce_async` starts a sum and
returns a `PendingReduce` to wait on (the MoE layer's micro-batches reduce under the next one's experts).

    column parallel   out features split: each rank computes its slice, no communication
    row parallel      in features split: partial outputs, one all-reduce, bias added once after it
    vocab parallel    embedding rows / LM head rows split (vocab padded to a multiple of tp):
                      embedding: ids outside the rank's rows give zeros, then one all-reduce;
                      LM head: each rank's logits slice, one all-gather, padding columns cut

Legend: T tokens, D hidden, V vocabulary, Vl local vocabulary rows, I intermediate.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_infer.layers.linear import linear

# torch >= 2.13 renames all_gather_into_tensor / reduce_scatter_tensor (2.11 has only the old names)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class ShardGroup:
    """This rank's place on one mesh axis: the process group, its rank on it and the axis size."""

    group: Any = None  # torch.distributed.ProcessGroup; None on a single rank
    rank: int = 0
    size: int = 1
    # (what failed, the error) -> the exception to raise instead, naming the rank at fault (the mesh's)
    on_error: Optional[Callable[[str, BaseException], BaseException]] = field(default=None, compare=False)
    always: bool = False  # run the collectives over a group of one rank too (parallel.force_mesh: the mesh's cost)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside an axis of size {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError(f"an axis of size {self.size} needs a process group")

    @property
    def communicates(self) -> bool:
        """Whether the axis's collectives run: more than one rank, or a group of one kept on purpose (`always`)."""
        return self.size > 1 or (self.always and self.group is not None)

    def split(self, total: int, what: str) -> int:
        """total / size, raising (naming `what`) when it does not divide."""
        if total % self.size:
            raise ValueError(f"{what}={total} is not divisible by the {self.size} tensor-parallel ranks")
        return total // self.size

    def _failed(self, what: str, err: RuntimeError) -> BaseException:
        return err if self.on_error is None else self.on_error(what, err)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the axis, in place (identity on a single rank)."""
        if self.communicates:
            try:
                dist.all_reduce(x, group=self.group)
            except RuntimeError as err:
                raise self._failed("tensor-parallel all-reduce", err) from err
        return x

    def all_reduce_async(self, x: torch.Tensor) -> PendingReduce:
        """Start the sum over the axis, in place; `wait()` on the result returns x summed. A failure, at the start
        or at the wait, raises as `all_reduce`'s does (nothing to wait for on a single rank)."""
        if not self.communicates:
            return PendingReduce(x, None, self)
        try:
            work = dist.all_reduce(x, group=self.group, async_op=True)
        except RuntimeError as err:
            raise self._failed("tensor-parallel all-reduce", err) from err
        return PendingReduce(x, work, self)

    def all_gather_last(self, x_TL: torch.Tensor) -> torch.Tensor:
        """[T, L] per rank -> [T, size * L], ranks' slices side by side (identity on a single rank)."""
        if not self.communicates:
            return x_TL
        T, L = x_TL.shape
        out_RTL = x_TL.new_empty(self.size * T, L)
        try:
            _all_gather_single(out_RTL, x_TL.contiguous(), group=self.group)
        except RuntimeError as err:
            raise self._failed("tensor-parallel all-gather", err) from err
        return out_RTL.view(self.size, T, L).permute(1, 0, 2).reshape(T, self.size * L)

    def all_gather_rows(self, x_TL: torch.Tensor) -> torch.Tensor:
        """[T, ...] per rank -> [size * T, ...], rank-major (identity on a single rank)."""
        if not self.communicates:
            return x_TL
        out = x_TL.new_empty((self.size * x_TL.shape[0], *x_TL.shape[1:]))
        try:
            _all_gather_single(out, x_TL.contiguous(), group=self.group)
        except RuntimeError as err:
            raise self._failed("all-gather", err) from err
        return out

    def reduce_scatter_rows(self, x_NL: torch.Tensor) -> torch.Tensor:
        """[size * C, ...] per rank -> [C, ...]: chunk `rank` of the sum over the axis (identity on a single rank)."""
        if not self.communicates:
            return x_NL
        if x_NL.shape[0] % self.size:
            raise ValueError(f"reduce-scatter of {x_NL.shape[0]} rows over {self.size} ranks")
        out = x_NL.new_empty((x_NL.shape[0] // self.size, *x_NL.shape[1:]))
        try:
            _reduce_scatter_single(out, x_NL.contiguous(), group=self.group)
        except RuntimeError as err:
            raise self._failed("reduce-scatter", err) from err
        return out


@dataclass
class PendingReduce:
    """An all-reduce in flight (`ShardGroup.all_reduce_async`): x is summed once `wait()` returns it."""

    x: torch.Tensor
    work: Any  # torch.distributed.Work; None: nothing in flight (a single rank)
    shard: ShardGroup

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            try:
                self.work.wait()
            except RuntimeError as err:
                raise self.shard._failed("tensor-parallel all-reduce", err) from err
            self.work = None
        return self.x


SINGLE = ShardGroup()


class RowParallelLinear(nn.Module):
    """y = x_local @ W_local^T summed over the axis, + bias once. Parameters named as nn.Linear's."""

    def __init__(self, in_local: int, out_features: int, bias: bool, dtype: torch.dtype,
                 shard: ShardGroup = SINGLE, quant=None) -> None:
        """quant: a QuantSpec (moe_infer/quant.py): the weight stored quantized (where it covers dense layers)."""
        from moe_infer.quant import linear_quant

        super().__init__()
        self.shard = shard
        quant = linear_quant(quant)
        if quant is None:
            self.weight = nn.Parameter(torch.empty(out_features, in_local, dtype=dtype), requires_grad=False)
        else:
            from moe_infer.quant import quantized_param

            quantized_param(self, "weight", (out_features, in_local), quant, dtype)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.shard.communicates:
            return linear(x, self.weight, self.bias)
        y = self.shard.all_reduce(linear(x, self.weight))
        return y if self.bias is None else y + self.bias


def padded_vocab(vocab_size: int, shard: ShardGroup) -> int:
    return -(-vocab_size // shard.size) * shard.size


class VocabParallelEmbedding(nn.Module):
    """Rows [rank * Vl, (rank + 1) * Vl) of the (padded) embedding table on each rank."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, shard: ShardGroup = SINGLE) -> None:
        super().__init__()
        self.shard, self.vocab_size = shard, vocab_size
        self.num_local = padded_vocab(vocab_size, shard) // shard.size
        self.start = shard.rank * self.num_local
        self.weight = nn.Parameter(torch.zeros(self.num_local, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, ids_T: torch.Tensor) -> torch.Tensor:
        if not self.shard.communicates:
            return F.embedding(ids_T, self.weight)
        local_T = ids_T - self.start
        mine_T = (local_T >= 0) & (local_T < self.num_local)
        h_TD = F.embedding(local_T.clamp(0, self.num_local - 1), self.weight)
        h_TD = h_TD.masked_fill(~mine_T[:, None], 0)
        return self.shard.all_reduce(h_TD)


class ParallelLMHead(nn.Module):
    """logits [T, V] from each rank's vocabulary rows, gathered over the axis."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, shard: ShardGroup = SINGLE,
                 tied: Optional[VocabParallelEmbedding] = None) -> None:
        super().__init__()
        self.shard, self.vocab_size = shard, vocab_size
        self.num_local = padded_vocab(vocab_size, shard) // shard.size
        self.start = shard.rank * self.num_local
        self.weight = (tied.weight if tied is not None else
                       nn.Parameter(torch.zeros(self.num_local, hidden_size, dtype=dtype), requires_grad=False))

    def forward(self, h_TD: torch.Tensor) -> torch.Tensor:
        logits_TVl = F.linear(h_TD, self.weight)
        if not self.shard.communicates:
            return logits_TVl
        return self.shard.all_gather_last(logits_TVl)[:, :self.vocab_size]

    def forward_into(self, h_TD: torch.Tensor, out_TV: torch.Tensor) -> torch.Tensor:
        """forward(h_TD) written into out_TV (a static buffer: the decode graphs' logits) and returned. Over several
        ranks: each rank's slice, one all-gather, then one copy of the ranks' slices side by side into out_TV."""
        if not self.shard.communicates:
            return torch.matmul(h_TD, self.weight.t(), out=out_TV)
        gathered_TV = self.shard.all_gather_last(F.linear(h_TD, self.weight))
        return out_TV.copy_(gathered_TV[:, :self.vocab_size])
