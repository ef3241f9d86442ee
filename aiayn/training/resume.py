"""Going on from a checkpoint: the weights, optimizer, schedule and loss scale, the data
cursor (moved to this run's process count and micro-batches), every rank's RNG state, and
the run's history, so that a resumed run ends bitwise where an unbroken one ends (CPU)."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import torch

from aiayn.data.batching import StepPlan
from aiayn.data.sampler import ShardDataset
from aiayn.training.distributed import World
from aiayn.training.run_log import RunLog

log = logging.getLogger("aiayn")


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state()[1].copy().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    legacy = np.random.get_state()
    np.random.set_state((legacy[0], np.asarray(state["numpy"], dtype=np.uint32), *legacy[2:]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, list | tuple) else x


def gather_rng_states(world: World) -> list[dict]:
    """Every rank's RNG state (collective), so that each rank's dropout resumes exactly."""
    mine = rng_state()
    if not world.distributed:
        return [mine]
    gathered: list = [None] * world.size
    torch.distributed.all_gather_object(gathered, mine)
    return gathered


def restore(ckpt: dict, path: Path, *, model, optimizer, scheduler, scaler, loader,
            train_data: ShardDataset, plan: StepPlan, world: World, seed: int):
    """Load ``ckpt`` (read from ``path``) into the components; returns the run's
    (:class:`aiayn.training.loop.RunState`, RunLog)."""
    from aiayn.training.loop import RunState

    # A run from before batches were planned at start-up took the shard stage's own.
    saved_tokens = int(ckpt["meta"].get("batch_tokens", train_data.meta["max_tokens"]))
    saved_world = ckpt["meta"].get("world_size")
    if saved_world != world.size or saved_tokens != plan.batch_tokens:
        ckpt["data"] = rescale_cursor(ckpt["data"], saved_world, saved_tokens, train_data,
                                      plan, world)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    if ckpt["data"] is not None:
        loader.load_state_dict(ckpt["data"])
    if ckpt.get("scaler"):
        scaler.load_state_dict(ckpt["scaler"])
    run = ckpt["run"]
    state = RunState(step=run["step"], tokens_seen=run["tokens_seen"],
                     elapsed_s=run["elapsed_s"], bleu_seconds=run.get("bleu_seconds", 0.0),
                     stable_step=run.get("stable_step"),
                     rdrop_from_step=run.get("rdrop_from_step"),
                     window=[float(x) for x in run.get("window", [0.0, 0.0, 0.0])],
                     window_s=float(run.get("window_s", 0.0)),
                     interim={run["step"]} if ckpt["meta"].get("interim") else set())
    rngs = ckpt["rng"]
    if world.rank < len(rngs):
        set_rng_state(rngs[world.rank])
    else:  # a rank the run did not have: its own dropout stream, not rank 0's again
        set_rng_state(rngs[0])
        torch.manual_seed(seed + 1 + world.rank + 7919 * run["step"])
    log.info("resumed from %s (step %d, %d target tokens seen)", path, state.step,
             state.tokens_seen)
    return state, RunLog.from_saved(run)


def rescale_cursor(cursor: dict | None, saved_world: int | None, saved_tokens: int,
                   train_data: ShardDataset, plan: StepPlan, world: World) -> dict | None:
    """The data cursor of a run saved with ``saved_world`` processes taking micro-batches of
    ``saved_tokens`` tokens, for this run's ``plan``.

    The same micro-batches (only the process count changed): every epoch's order is one
    permutation of them whatever the world size (rank r takes positions r, r + N, ...), so
    the batches taken so far are the first position x N of it and the run goes on from
    there, none repeated (up to N - 1 skipped). Other micro-batches (the step is split anew:
    another process count with train.max_tokens 0, or another train.max_tokens): the
    epoch's order is of other batches, so the run goes on at the same share of it; until
    that epoch ends some pairs may come twice and others not at all, and each later epoch
    sees every pair once, as always. Both are said in the log.
    """
    size, n = world.size, train_data.num_batches
    per_rank = -(-n // size)
    if cursor is None or not saved_world:
        log.warning("resuming a run made with %s processes on %d: the data order changes "
                    "from here on", saved_world, size)
        return None
    epoch, position = int(cursor["epoch"]), int(cursor["position"])
    if saved_tokens == plan.batch_tokens:
        new = min(-(-position * saved_world // size), per_rank)
        if world.is_main:
            log.warning("resuming a run made with %d processes on %d, with the same "
                        "micro-batches: the data goes on from the same place in epoch %d's "
                        "order (%d batches per process, was %d)", saved_world, size, epoch,
                        per_rank, -(-n // saved_world))
        return {"epoch": epoch, "position": new}
    old_n = len(train_data.plan_batches(saved_tokens))
    share = min(1.0, position / -(-old_n // saved_world))
    new = min(round(share * per_rank), per_rank)
    if world.is_main:
        log.warning(
            "resuming a run whose micro-batches were planned for %d process(es) x <= %d "
            "tokens, now %s: the rest of epoch %d is cut anew and goes on at the same share "
            "of it (%.0f%%); until that epoch ends some pairs may come twice and others not "
            "at all, and from epoch %d on every pair comes once an epoch again",
            saved_world, saved_tokens, plan.describe(), epoch, 100 * share, epoch + 1)
    return {"epoch": epoch, "position": new}
