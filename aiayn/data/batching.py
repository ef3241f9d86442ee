"""How an optimizer step's token budget becomes micro-batches, planned when training starts.

The shard stage stores every split's pairs sorted by length (:mod:`aiayn.data.shards`). Training
does not take the shard stage's batches as they are: it plans its own from those sorted pairs
for the step it must take on the processes it has, as fairseq plans its batches from an
indexed dataset at start-up. So ``train.tokens_per_step`` is the optimizer step on one
process or on many, and a change of GPU count never re-runs a data stage.

* :func:`plan_step`: ``tokens_per_step`` over ``world_size`` processes, each accumulating
  ``accumulation`` micro-batches of at most ``batch_tokens`` tokens per side (padding
  included). By default one micro-batch a process a step (the fastest on a GPU); with
  ``train.max_tokens`` the micro-batch is capped (a GPU's memory) and accumulation grows.
* :func:`plan_stored_batches`: the micro-batches themselves, cut from the stored pairs with
  the shard stage's own greedy rule (:func:`aiayn.data.shards.cut_batches`), shard by shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from aiayn.data.shards import TGT_EXTRA, cut_batches


@dataclass(frozen=True)
class StepPlan:
    """One optimizer step: ``world_size`` x ``accumulation`` micro-batches of at most
    ``batch_tokens`` tokens per side, padding included."""

    tokens_per_step: int
    world_size: int
    accumulation: int
    batch_tokens: int

    @property
    def capacity(self) -> int:
        """The most tokens a step's micro-batches can hold on a side (padding included)."""
        return self.world_size * self.accumulation * self.batch_tokens

    def describe(self) -> str:
        return (f"{self.world_size} process(es) x {self.accumulation} micro-batch(es) of "
                f"<= {self.batch_tokens:,} tokens per step (train.tokens_per_step "
                f"{self.tokens_per_step:,})")


def plan_step(tokens_per_step: int, world_size: int, max_tokens: int = 0) -> StepPlan:
    """Split ``tokens_per_step`` over ``world_size`` processes.

    ``max_tokens`` 0: one micro-batch per process, of ``ceil(tokens_per_step / world_size)``
    tokens. Otherwise the fewest micro-batches per process that keep each within
    ``max_tokens``, all of the same size: ``accumulation = ceil(tokens_per_step /
    (world_size * max_tokens))`` and ``batch_tokens = ceil(tokens_per_step / (world_size *
    accumulation))``. Either way the step's capacity is the budget rounded up to a whole
    token per micro-batch: ``tokens_per_step <= capacity < tokens_per_step + world_size *
    accumulation``.
    """
    if tokens_per_step <= 0 or world_size <= 0 or max_tokens < 0:
        raise ValueError(f"no step plan for tokens_per_step {tokens_per_step}, world size "
                         f"{world_size}, max_tokens {max_tokens}")
    accumulation = 1 if max_tokens == 0 else max(
        1, math.ceil(tokens_per_step / (world_size * max_tokens)))
    batch_tokens = math.ceil(tokens_per_step / (world_size * accumulation))
    return StepPlan(tokens_per_step, world_size, accumulation, batch_tokens)


def pair_costs(src_offsets: np.ndarray, tgt_offsets: np.ndarray) -> tuple[np.ndarray,
                                                                          np.ndarray]:
    """The tokens each stored pair takes in a batch, per side, from a shard's offsets: the
    source as stored (ids + EOS), the target one less than stored (BOS + ids + EOS is read as
    decoder input and labels, each ids + 1 long)."""
    src = np.diff(np.asarray(src_offsets, dtype=np.int64))
    tgt = np.diff(np.asarray(tgt_offsets, dtype=np.int64)) - (TGT_EXTRA - 1)
    return src, tgt


def longest_pair(shards: list[tuple[np.ndarray, np.ndarray]]) -> int:
    """The most tokens one stored pair takes on either side (the smallest batch that fits
    every pair), over shards given as (source offsets, target offsets)."""
    longest = 0
    for src_offsets, tgt_offsets in shards:
        src, tgt = pair_costs(src_offsets, tgt_offsets)
        if src.size:
            longest = max(longest, int(src.max()), int(tgt.max()))
    return longest


def plan_stored_batches(shards: list[tuple[np.ndarray, np.ndarray]],
                        max_tokens: int) -> np.ndarray:
    """Batches of at most ``max_tokens`` tokens per side (padding included) over stored pairs,
    as the shard stage's table: int64 [num_batches, 3] of (shard, start row, end row).

    ``shards`` are (source offsets, target offsets) per shard, in stored (length-sorted)
    order. A batch never spans two shards. With the ``max_tokens`` the shard stage used, this
    is the table it wrote (its cut is the same greedy rule over the same sorted pairs).
    """
    tables = []
    for k, (src_offsets, tgt_offsets) in enumerate(shards):
        src, tgt = pair_costs(src_offsets, tgt_offsets)
        bounds = cut_batches(src, tgt, max_tokens)
        table = np.empty((bounds.size - 1, 3), dtype=np.int64)
        table[:, 0] = k
        table[:, 1] = bounds[:-1]
        table[:, 2] = bounds[1:]
        tables.append(table)
    return np.concatenate(tables) if tables else np.zeros((0, 3), dtype=np.int64)
