"""The training loop (Section 5): a plain loop around small components.

* batches: the shard stage's token-budget batches, dealt to ranks by TokenBudgetSampler;
* one optimizer step sees ``train.tokens_per_step`` target tokens (capacity) whatever the
  world size: the micro-batches are planned when training starts from the shards' sorted
  pairs, one per process a step unless ``train.max_tokens`` caps them (aiayn.batching);
* the loss of a step is the sum over every target token of every micro-batch on every
  rank divided by their global count, so 1 process x 2 accumulation steps and 2 processes
  x 1 step compute the same update;
* checkpoints every N steps and/or T minutes hold the model, optimizer, scheduler, every
  RNG state, the data cursor and the run log (aiayn.run_log), so a killed run resumes and
  ends bitwise where an uninterrupted one ends (CPU); the checkpoint folder's policy (which
  run resumes, setting runs aside, recovery after `dvc exp run`, the cooldown's branch
  point, rotation) is the run store's (aiayn.run_store);
* ``train.max_minutes`` is a time budget over all sessions of a run: when it is spent the
  run validates, writes a checkpoint and stops (as fairseq's --stop-time-hours);
* with ``train.cooldown`` the lr falls linearly to zero over the last part of the run,
  its end being train.steps or the time budget, whichever comes first;
* ``train.kernels: fast`` computes the same step with aiayn.fast (fused output-projection
  loss, cheap dropout masks) and fused Adam; ``plain`` with torch's own operators;
* the next batches are read by a background thread (pinned for a GPU), and loss sums and
  token counts stay on the device: the host waits for the device only at logging,
  checkpoint and stop steps, never per micro-batch;
* every ``train.valid_bleu_every`` steps rank 0 translates the valid set through a hook
  (aiayn.translation.ValidationBleu) and scores sacreBLEU, while the other ranks wait;
* log rows go to metrics/ (git, DVC plots) and, from rank 0, to the tracker the stage
  hands in (aiayn.tracking: MLflow), which owns the MLflow run.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from aiayn import distributed, fast
from aiayn.batching import StepPlan, plan_step
from aiayn.config import Params, TrainConfig
from aiayn.distributed import World
from aiayn.errors import AiaynError, DataError, ParamsError
from aiayn.io import write_json
from aiayn.memory import HeapTrimmer, loaded_allocator
from aiayn.model import Transformer, TransformerConfig, count_parameters
from aiayn.objective import make_criterion, make_optimizer
from aiayn.precision import (
    autocast_dtype,
    hardware,
    no_autocast,
    precision_name,
    slow_bf16_warning,
    step_casts,
)
from aiayn.run_log import RunLog, TrainRow, ValidRow
from aiayn.run_store import RunStore, run_identity
from aiayn.sampler import Batch, BatchLoader, PrefetchLoader, ShardDataset, TokenBudgetSampler
from aiayn.schedule import cooldown_factor, deep_post_ln_warning
from aiayn.shards import check_tokenizer
from aiayn.subword import SubwordSplitter, split_closure

log = logging.getLogger("aiayn")

class TrainingDiverged(AiaynError):
    """The loss became NaN or infinite."""


class OutOfMemory(AiaynError):
    """A batch did not fit in memory."""


@dataclass
class TrainPaths:
    shards: Path = Path("data/shards")
    checkpoints: Path = Path("data/checkpoints")
    metrics: Path = Path("metrics/train.json")
    train_log: Path = Path("metrics/train_log.tsv")
    valid_log: Path = Path("metrics/valid_log.tsv")

    @property
    def valid_bleu_log(self) -> Path:
        """Step and validation BLEU of the steps that have one, beside the valid log."""
        return self.valid_log.with_name("valid_bleu.tsv")


@dataclass
class RunState:
    """Everything besides model, optimizer and the run log that a resumed run needs."""

    step: int = 0
    tokens_seen: int = 0
    elapsed_s: float = 0.0  # training wall time summed over all sessions of this run
    mlflow_run_id: str | None = None
    bleu_seconds: float = 0.0  # time spent in validation BLEU (inside elapsed_s)
    stable_step: int | None = None  # the newest checkpoint taken at the full rate (no cooldown)
    stopped_by: str | None = None  # "steps", "time budget" or "interrupted"


def model_config(p: Params, vocab_size: int) -> TransformerConfig:
    m = p.model
    return TransformerConfig(
        vocab_size=vocab_size, d_model=m.d_model, heads=m.heads, encoder_layers=m.encoder_layers,
        decoder_layers=m.decoder_layers, d_ff=m.d_ff, dropout=m.dropout,
        attention_dropout=p.train.attention_dropout,
        activation_dropout=p.train.activation_dropout, norm=m.norm,
        max_positions=m.max_positions, output_vocab=m.output_vocab, d_k=m.d_k, d_v=m.d_v,
        positions=m.positions, position_init_std=m.position_init_std)


def device_kind(choice: str) -> str:
    """'cuda' or 'cpu': where ``train.device`` ``choice`` trains on this machine (no side
    effects: the allocator is chosen from it before the process sets a device up)."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise AiaynError("train.device is 'cuda' but no GPU is visible; set train.device: "
                             "auto or cpu")
        return "cuda"
    return "cpu"


def pick_device(choice: str, world: World) -> torch.device:
    if device_kind(choice) == "cuda":
        torch.cuda.set_device(world.local_rank)
        return torch.device("cuda", world.local_rank)
    return torch.device("cpu")


def lr_multiplier(t: TrainConfig, step: int, elapsed_s: float) -> float:
    """train.cooldown's lr multiplier for the step after ``step`` steps and ``elapsed_s``
    seconds of training: how much is done is the steps taken of train.steps, or the time
    spent of train.max_minutes if further on."""
    progress = step / t.steps
    if t.max_minutes:
        progress = max(progress, elapsed_s / (60 * t.max_minutes))
    return cooldown_factor(progress, t.cooldown)


def open_training_data(shards: Path, plan: StepPlan) -> tuple[ShardDataset, ShardDataset]:
    """The train and valid splits with batches planned for ``plan`` (aiayn.batching): each
    process's micro-batches hold at most ``plan.batch_tokens`` tokens per side, validation's
    too (a process's memory is sized for that). A budget too small for the longest stored
    pair is a ParamsError naming the settings that fix it."""
    opened = []
    for split in ("train", "valid"):
        data = ShardDataset(shards / split)
        if (longest := data.longest_pair()) > plan.batch_tokens:
            raise ParamsError(
                f"train: {plan.describe()}: a micro-batch of {plan.batch_tokens:,} tokens "
                f"cannot hold the longest {split} pair of {shards / split} ({longest} tokens "
                "on one side, with its special token); raise train.tokens_per_step or "
                "train.max_tokens, train on fewer processes, or lower shard.max_len and "
                "re-run the shard stage")
        data.replan(plan.batch_tokens)
        opened.append(data)
    return opened[0], opened[1]


def target_vocabulary(datasets: list[ShardDataset], pad_id: int, bos_id: int,
                      parents: np.ndarray | None = None) -> np.ndarray:
    """The token ids that ``model.output_vocab: target`` lets the softmax span, ascending:
    every token of the target side of ``datasets`` but BOS (never predicted), with
    ``parents`` (train.subword_split) every token splitting them can yield, and the padding
    id (a column that is never a label, as in the whole-vocabulary softmax)."""
    seen = np.zeros(int(datasets[0].meta["vocab_size"]), dtype=bool)
    for ds in datasets:
        seen |= ds.token_counts("tgt") > 0
    seen[bos_id] = False
    if parents is not None:
        seen = split_closure(seen, parents)
        seen[bos_id] = False
    seen[pad_id] = True
    return np.flatnonzero(seen)


# --------------------------------------------------------------------------- RNG state


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


# --------------------------------------------------------------------------- the loop


class Trainer:
    """The training loop (see the module's docstring) around its components: the model and
    optimizer, the batch loader, the run store (aiayn.run_store: the checkpoint folder) and
    the run log (aiayn.run_log)."""

    def __init__(self, p: Params, vocab_size: int, tokenizer_sha256: str, paths: TrainPaths,
                 world: World, tracker=None, progress: bool = True,
                 valid_bleu: Callable[..., float] | None = None,
                 merges: np.ndarray | None = None):
        """``tracker`` (aiayn.tracking.Tracker) receives every log row as it is made.
        ``valid_bleu(model, device, amp_dtype) -> score`` is called by rank 0 every
        ``train.valid_bleu_every`` steps (aiayn.translation.ValidationBleu). ``merges``
        (aiayn.subword.merge_parents of the tokenizer) is needed by train.subword_split."""
        self.p, self.paths, self.world, self.tracker = p, paths, world, tracker
        self.valid_bleu = valid_bleu
        self.progress = progress and world.is_main
        self.device = pick_device(p.train.device, world)
        distributed.init(world, self.device)
        self.amp_dtype = autocast_dtype(p.train.precision, self.device)
        if (warning := slow_bf16_warning(p.train.precision, self.device, "train.precision")) \
                and world.is_main:
            log.warning(warning)
        self.cfg = model_config(p, vocab_size)
        self.fingerprint = {"model_config": self.cfg.to_dict(), "vocab_size": vocab_size,
                            "tokenizer_sha256": tokenizer_sha256}

        self.fast = p.train.kernels == "fast"
        torch.manual_seed(p.seed)  # identical initial weights on every rank
        self.model = Transformer(self.cfg).to(self.device)
        fast.avoid_cudnn_attention(self.device)  # on CUDA, whatever the kernels: process-wide
        if self.fast:  # the C++ kernels built here (~30 s once per machine), not in step 1
            fast.apply(self.model, fast.KernelConfig())
        self.optimizer, self.scheduler = make_optimizer(
            self.model, p.train.adam_betas, p.train.adam_eps, p.model.d_model,
            p.train.warmup_steps, p.train.lr_scale, fused=self.fast)
        if world.is_main and (warning := deep_post_ln_warning(p.model, p.train)):
            log.warning(warning)
        # fp16's dynamic loss scaling (train.precision: fp16): the loss is multiplied before
        # backward so that small gradients stay representable, the gradients divided back
        # before clipping and Adam, and a step whose gradients overflowed is skipped while
        # the scale halves. Off (a no-op) in every other precision.
        self.scaler = torch.amp.GradScaler(self.device.type,
                                           enabled=self.amp_dtype == torch.float16)

        self.plan = plan_step(p.train.tokens_per_step, world.size, p.train.max_tokens)
        self.train_data, self.valid_data = open_training_data(paths.shards, self.plan)
        self._check_vocab(vocab_size)
        check_tokenizer(paths.shards, tokenizer_sha256)
        self.identity = run_identity(p, self.cfg, tokenizer_sha256, paths.shards)
        self.store = RunStore(paths.checkpoints, world, self.device, self.identity,
                              lr_factor=functools.partial(lr_multiplier, p.train),
                              end={"steps": p.train.steps, "max_minutes": p.train.max_minutes})
        if world.is_main:  # the weights and Adam's two moments
            self.store.check_room(3 * sum(q.numel() * q.element_size()
                                          for q in self.model.parameters()),
                                  p.train.keep_checkpoints)
        self.sampler = TokenBudgetSampler(self.train_data.num_batches, world.rank, world.size,
                                          seed=p.seed)
        splitter = self._splitter(merges, vocab_size)
        self.loader = PrefetchLoader(BatchLoader(self.train_data, self.sampler,
                                                 splitter=splitter),
                                     pin_memory=self.device.type == "cuda")
        if self.cfg.output_vocab == "target":  # saved with the weights: resuming restores it
            self.model.set_output_vocab(torch.from_numpy(target_vocabulary(
                [self.train_data, self.valid_data], self.cfg.pad_id,
                int(self.train_data.meta["bos_id"]),
                splitter.parents if splitter is not None else None)))
        # Varied batch shapes fragment glibc's heap on CPU; trimming keeps RSS flat (tcmalloc
        # and jemalloc, train.allocator, keep their own heaps).
        self.allocator = loaded_allocator()
        self.heap = HeapTrimmer(enabled=self.device.type == "cpu" and self.allocator == "glibc")
        self.state = RunState()
        self.log = RunLog()
        # Device-side sums of [target tokens, loss, NLL] since the last flush (_flush).
        self._pending = torch.zeros(3, dtype=torch.float64, device=self.device)
        self._pending_from = 1  # first step the pending sums cover
        # The open log row: [target tokens, loss sum, NLL sum] flushed since the last row
        # (a checkpoint flushes too), and the training seconds it covers; saved with each
        # checkpoint, so that the row after a resume holds what an unbroken run's would.
        self._window = [0.0, 0.0, 0.0]
        self._window_s = 0.0
        # The step of a checkpoint written only to stop (Ctrl-C, SIGTERM), not by the
        # checkpoint rule: the next checkpoint replaces it, so that a resumed run keeps the
        # checkpoints (and averages those) that an unbroken run keeps.
        self._interim: set[int] = set()
        # The last step whose rows the MLflow run already holds, by row type: a run killed
        # after its last checkpoint logged the rows after it, and repeats them on resuming.
        self.tracked_until: dict[type, int] = {}
        self._grad_norm: torch.Tensor | None = None
        self._lr = 0.0
        if (found := self.store.resume_point()) is not None:
            self._load(*found)
        self.output_vocab = self.model.output_vocab()  # as the (resumed) weights say
        self.criterion = make_criterion(
            kernels=p.train.kernels, label_smoothing=p.train.label_smoothing,
            rdrop=p.train.rdrop, pad_id=self.cfg.pad_id, embedding=self.model.embedding.weight,
            amp_dtype=self.amp_dtype, output=self.output_vocab)
        # Dropout differs between ranks; the seed offset keeps it reproducible per rank.
        if self.state.step == 0:
            torch.manual_seed(p.seed + 1 + world.rank)
        self.net: nn.Module = self.model
        if world.distributed:
            self.net = nn.parallel.DistributedDataParallel(
                self.net, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        if p.train.compile:
            # After DDP, so that Dynamo splits the graph at DDP's gradient buckets and the
            # all-reduce of one overlaps the backward of the next. Shapes become symbolic
            # after the first new batch shape: 2 graphs whatever the number of shapes.
            self.net = torch.compile(self.net)

    @property
    def branched_from(self) -> dict | None:
        """{"mlflow_run_id", "step"} when this run goes on from before its cooldown
        (aiayn.run_store), else None."""
        return self.store.branched_from

    # -- setup helpers ----------------------------------------------------------------

    def _check_vocab(self, vocab_size: int) -> None:
        for ds, name in ((self.train_data, "train"), (self.valid_data, "valid")):
            if int(ds.meta["vocab_size"]) != vocab_size:
                raise DataError(
                    f"{self.paths.shards / name}/meta.json: shards were made with a vocabulary "
                    f"of {ds.meta['vocab_size']} tokens, the tokenizer has {vocab_size}; re-run "
                    "`aiayn survey` and `aiayn shard` (or `dvc repro`)")

    def _splitter(self, merges: np.ndarray | None, vocab_size: int) -> SubwordSplitter | None:
        """train.subword_split's re-segmentation of training batches (aiayn/subword.py)."""
        if self.p.train.subword_split == 0:
            return None
        if merges is None or merges.shape != (vocab_size, 2):
            raise ValueError("train.subword_split needs the tokenizer's merges "
                             "(aiayn.subword.merge_parents) for all "
                             f"{vocab_size} tokens, got "
                             f"{None if merges is None else list(merges.shape)}")
        return SubwordSplitter(merges, self.p.train.subword_split, self.p.seed,
                               max_len=self.cfg.max_positions)

    def _load(self, path: Path, ckpt: dict) -> None:
        """Go on from checkpoint ``ckpt``: weights, optimizer, schedule, data cursor, RNG
        states and the run's history."""
        # A run from before batches were planned at start-up took the shard stage's own.
        saved_tokens = int(ckpt["meta"].get("batch_tokens", self.train_data.meta["max_tokens"]))
        saved_world = ckpt["meta"].get("world_size")
        if saved_world != self.world.size or saved_tokens != self.plan.batch_tokens:
            ckpt["data"] = self._rescale_cursor(ckpt["data"], saved_world, saved_tokens)
        self.model.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        if ckpt["data"] is not None:
            self.loader.load_state_dict(ckpt["data"])
        if ckpt.get("scaler"):
            self.scaler.load_state_dict(ckpt["scaler"])
        run = ckpt["run"]
        self.state = RunState(step=run["step"], tokens_seen=run["tokens_seen"],
                              elapsed_s=run["elapsed_s"],
                              mlflow_run_id=ckpt["meta"].get("mlflow_run_id"),
                              bleu_seconds=run.get("bleu_seconds", 0.0),
                              stable_step=run.get("stable_step"))
        self.log = RunLog.from_saved(run)
        self._window = [float(x) for x in run.get("window", [0.0, 0.0, 0.0])]
        self._window_s = float(run.get("window_s", 0.0))
        if ckpt["meta"].get("interim"):
            self._interim = {run["step"]}
        rngs = ckpt["rng"]
        if self.world.rank < len(rngs):
            set_rng_state(rngs[self.world.rank])
        else:  # a rank the run did not have: its own dropout stream, not rank 0's again
            set_rng_state(rngs[0])
            torch.manual_seed(self.p.seed + 1 + self.world.rank + 7919 * run["step"])
        log.info("resumed from %s (step %d, %d target tokens seen)", path, self.state.step,
                 self.state.tokens_seen)

    def _rescale_cursor(self, cursor: dict | None, saved_world: int | None,
                        saved_tokens: int) -> dict | None:
        """The data cursor of a run saved with ``saved_world`` processes taking micro-batches
        of ``saved_tokens`` tokens, for this run's plan.

        The same micro-batches (only the process count changed): every epoch's order is one
        permutation of them whatever the world size (rank r takes positions r, r + N, ...),
        so the batches taken so far are the first position x N of it and the run goes on
        from there, none repeated (up to N - 1 skipped). Other micro-batches (the step is
        split anew: another process count with train.max_tokens 0, or another
        train.max_tokens): the epoch's order is of other batches, so the run goes on at the
        same share of it; until that epoch ends some pairs may come twice and others not at
        all, and each later epoch sees every pair once, as always. Both are said in the log.
        """
        size, n = self.world.size, self.train_data.num_batches
        per_rank = -(-n // size)
        if cursor is None or not saved_world:
            log.warning("resuming a run made with %s processes on %d: the data order changes "
                        "from here on", saved_world, size)
            return None
        epoch, position = int(cursor["epoch"]), int(cursor["position"])
        if saved_tokens == self.plan.batch_tokens:
            new = min(-(-position * saved_world // size), per_rank)
            if self.world.is_main:
                log.warning("resuming a run made with %d processes on %d, with the same "
                            "micro-batches: the data goes on from the same place in epoch "
                            "%d's order (%d batches per process, was %d)", saved_world, size,
                            epoch, per_rank, -(-n // saved_world))
            return {"epoch": epoch, "position": new}
        old_n = len(self.train_data.plan_batches(saved_tokens))
        share = min(1.0, position / -(-old_n // saved_world))
        new = min(round(share * per_rank), per_rank)
        if self.world.is_main:
            log.warning(
                "resuming a run whose micro-batches were planned for %d process(es) x <= %d "
                "tokens, now %s: the rest of epoch %d is cut anew and goes on at the same "
                "share of it (%.0f%%); until that epoch ends some pairs may come twice and "
                "others not at all, and from epoch %d on every pair comes once an epoch again",
                saved_world, saved_tokens, self.plan.describe(), epoch, 100 * share, epoch + 1)
        return {"epoch": epoch, "position": new}

    # -- one optimizer step -----------------------------------------------------------

    def _micro_batches(self, it: Iterator[Batch]) -> list[Batch]:
        return [next(it) for _ in range(self.plan.accumulation)]

    def _forward_loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, int]:
        if batch.is_empty:
            # An empty batch (the last round of an epoch) still runs a forward and backward
            # so that DDP's gradient all-reduce happens on every rank; its labels are all
            # padding, so it adds nothing.
            pad = self.cfg.pad_id
            one = torch.full((1, 1), pad, dtype=torch.long)
            none = torch.zeros(0, dtype=torch.long)
            batch = Batch(one, one, one, torch.zeros(1, dtype=torch.long), 0, 0,
                          tgt_positions=none)
        return self._loss(self.net, batch.to(self.device, non_blocking=True))

    def _loss(self, net: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.criterion(net, batch)

    def train_step(self, batches: list[Batch]) -> None:
        """Accumulate gradients over this rank's micro-batches and take one Adam step.

        Nothing here waits for the device: the step's token count and loss sums are added
        to device-side totals that :meth:`_flush` reads at logging and checkpoint steps.
        """
        local_tokens = sum(b.tgt_tokens for b in batches)
        if self.world.distributed:  # the global count, as a device tensor (no host sync)
            global_tokens = distributed.all_sum_(
                torch.tensor(float(local_tokens), dtype=torch.float64, device=self.device),
                self.world)
        else:
            if local_tokens == 0:
                raise DataError("an optimizer step got no target tokens; the shards are empty?")
            global_tokens = local_tokens
        # DDP averages gradients over ranks; multiplying by world size makes the step's
        # gradient the sum over all tokens divided by their global count.
        scale = self.world.size / global_tokens
        device = self.device.type
        with step_casts(device, self.amp_dtype):  # weights cast to bf16 once per step
            for i, batch in enumerate(batches):
                sync = i == len(batches) - 1 or not self.world.distributed
                ctx = contextlib.nullcontext() if sync else self.net.no_sync()
                with ctx:
                    loss, nll, _ = self._forward_loss(batch)
                    with no_autocast(device):
                        self.scaler.scale(loss * scale).backward()
                self._pending[1] += loss.detach()
                self._pending[2] += nll.detach()
        self._pending[0] += local_tokens
        params = [q for q in self.model.parameters() if q.grad is not None]
        if self.scaler.is_enabled():  # the true gradients, for clipping, the norm and Adam
            self.scaler.unscale_(self.optimizer)
        if self.p.train.clip_norm > 0:
            self._grad_norm = torch.nn.utils.clip_grad_norm_(params, self.p.train.clip_norm)
        elif self._logs_at(self.state.step + 1):  # the norm is only shown, not used
            self._grad_norm = torch.nn.utils.get_total_norm([q.grad for q in params])
        self._lr = self.scheduler.get_last_lr()[0] * self.cooldown_factor()
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr
        self.scaler.step(self.optimizer)  # skipped where fp16 gradients overflowed
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1

    def cooldown_factor(self) -> float:
        """train.cooldown's lr multiplier for the next step (:func:`lr_multiplier`), from rank
        0's clock, so every rank agrees. The time part makes a budgeted run's rates depend on
        the machine's speed, as its last step already does."""
        return lr_multiplier(self.p.train, self.state.step, self.state.elapsed_s)

    def _logs_at(self, step: int) -> bool:
        return step % self.p.train.log_every == 0 or step == self.p.train.steps

    def _flush(self) -> tuple[float, float, float]:
        """Read (and zero) the device-side sums since the last flush, summed over ranks:
        (target tokens, loss sum, NLL sum). Every rank calls it at the same steps.

        A non-finite loss stops training here, before anything is logged or checkpointed,
        so every checkpoint on disk holds finite weights.
        """
        tokens, loss, nll = distributed.all_sum_(self._pending, self.world).tolist()
        self._pending.zero_()
        first, last = self._pending_from, self.state.step
        self._pending_from = last + 1
        if not math.isfinite(loss):
            self.optimizer.zero_grad(set_to_none=True)
            when = f"at step {last}" if first >= last else f"between steps {first} and {last}"
            raise TrainingDiverged(
                f"the training loss became {loss} {when}; nothing was written since, the "
                f"last good checkpoint is in {self.paths.checkpoints}. Lower train.lr_scale, "
                "raise train.warmup_steps or set train.clip_norm, then run again (it resumes "
                "from that checkpoint)")
        self.state.tokens_seen += int(tokens)
        return tokens, loss, nll

    # -- validation ---------------------------------------------------------------------

    @torch.no_grad()
    def validate(self) -> dict:
        self.model.eval()
        sampler = TokenBudgetSampler(self.valid_data.num_batches, self.world.rank,
                                     self.world.size, seed=self.p.seed, shuffle=False)
        loss_sum = nll_sum = tokens = 0.0
        for index in sampler.epoch_iter():
            batch = self.valid_data.batch(index)
            if batch.is_empty:
                continue
            loss, nll, n = self._loss(self.model, batch.to(self.device))
            loss_sum, nll_sum = loss_sum + loss.item(), nll_sum + nll.item()
            tokens += int(n)
        loss_sum, nll_sum, tokens = distributed.all_sum([loss_sum, nll_sum, tokens],
                                                        self.device, self.world)
        self.model.train()
        nll = nll_sum / max(tokens, 1)
        return {"valid_loss": loss_sum / max(tokens, 1), "valid_nll": nll,
                "valid_ppl": math.exp(min(nll, 50.0)), "tokens": int(tokens)}

    def _valid_bleu(self) -> float | None:
        """Rank 0 translates and scores; the other ranks wait for it."""
        score = None
        if self.world.is_main and self.valid_bleu is not None:
            start = time.perf_counter()
            score = float(self.valid_bleu(self.model, self.device, self.amp_dtype))
            self.state.bleu_seconds += time.perf_counter() - start
        if self.world.distributed:
            torch.distributed.barrier()
        return score

    # -- log rows, checkpoints --------------------------------------------------------------

    def _track(self, row: TrainRow | ValidRow) -> None:
        if self.tracker is not None and self.world.is_main:
            if row.step <= self.tracked_until.get(type(row), -1):
                return  # logged before a kill: the resumed run computes the same row again
            self.tracker.log_metrics(row.metrics(), step=row.step)

    def _log_train_row(self, window: list[float], seconds: float, bar) -> None:
        s = self.state
        tokens, loss, nll = window
        row = TrainRow(step=s.step, loss=loss / max(tokens, 1), nll=nll / max(tokens, 1),
                       lr=self._lr,
                       grad_norm=(float(self._grad_norm) if self._grad_norm is not None
                                  else float("nan")),
                       tokens=s.tokens_seen, tokens_per_s=tokens / max(seconds, 1e-9),
                       elapsed_s=s.elapsed_s)
        self.log.train.append(row)
        self._track(row)
        if bar is not None:
            bar.set_postfix(loss=f"{row.loss:.3f}", lr=f"{row.lr:.2e}",
                            tok_s=f"{row.tokens_per_s:,.0f}", refresh=False)

    def _log_valid_row(self, bleu: bool = False) -> None:
        v = self.validate()
        row = ValidRow(step=self.state.step, **v,
                       valid_bleu=self._valid_bleu() if bleu else None)
        self.log.valid.append(row)
        self._track(row)
        if self.world.is_main:
            log.info("step %d: valid loss %.4f, nll %.4f, ppl %.2f%s", row.step, row.valid_loss,
                     row.valid_nll, row.valid_ppl,
                     "" if row.valid_bleu is None else f", sacreBLEU {row.valid_bleu:.2f}")

    def write_logs(self) -> None:
        if self.world.is_main:
            self.log.write(self.paths.train_log, self.paths.valid_log, self.paths.valid_bleu_log)

    def _gather_rng(self) -> list[dict]:
        """Every rank's RNG state, so that each rank's dropout resumes exactly."""
        mine = rng_state()
        if not self.world.distributed:
            return [mine]
        gathered: list = [None] * self.world.size
        torch.distributed.all_gather_object(gathered, mine)
        return gathered

    def checkpoint(self, interim: bool = False) -> Path | None:
        """Save the run (every rank calls it). ``interim``: a checkpoint only to stop at a
        step the checkpoint rule did not choose; the next checkpoint replaces it."""
        # collective; refuses to write after a non-finite loss. The sums go on in the open
        # log row.
        self._window = [a + b for a, b in zip(self._window, self._flush(), strict=True)]
        rngs = self._gather_rng()  # collective: every rank calls it
        s, t = self.state, self.p.train
        factor = self.cooldown_factor()  # the next step's, under the end that made this one
        if factor == 1.0:
            s.stable_step = s.step
        if not self.world.is_main:
            return None
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),  # {} unless fp16
            "data": self.loader.state_dict(),
            "rng": rngs,
            "run": {"step": s.step, "tokens_seen": s.tokens_seen, "elapsed_s": s.elapsed_s,
                    **self.log.to_saved(), "window": list(self._window),
                    "window_s": self._window_s,
                    "bleu_seconds": s.bleu_seconds, "stable_step": s.stable_step},
            "meta": {**self.fingerprint, "identity": self.identity,
                     "mlflow_run_id": s.mlflow_run_id, "step": s.step,
                     "tokens_seen": s.tokens_seen, "world_size": self.world.size,
                     "batch_tokens": self.plan.batch_tokens,
                     "valid_bleu": self.log.bleu_at(s.step), "interim": interim,
                     "schedule": {"steps": t.steps, "max_minutes": t.max_minutes,
                                  "lr_factor": factor}},
        }
        # train.average "best": the best-BLEU checkpoints stay for the average stage; with a
        # cooldown, the last checkpoint before it stays: a run whose end moves later goes on
        # from there (aiayn.run_store).
        # The average stage may try up to max(train.average_candidates) of the best.
        wanted = max(t.average_candidates or [t.average_last])
        protect = self.log.best_bleu_steps(wanted) if t.average == "best" else set()
        if t.cooldown > 0 and s.stable_step is not None:
            protect |= {s.stable_step}
        replaced, self._interim = self._interim - {s.step}, {s.step} if interim else set()
        return self.store.save(s.step, state, t.keep_checkpoints, protect, replaced)

    # -- the run --------------------------------------------------------------------------

    def fit(self, should_stop: Callable[[], bool] = lambda: False) -> dict:
        """Train until train.steps, the time budget or a stop request, whichever comes first;
        returns :meth:`summary`."""
        p, s = self.p.train, self.state
        budget_s = 60 * p.max_minutes if p.max_minutes else math.inf
        if self.world.is_main:
            self._log_start()
        if s.step < p.steps and s.elapsed_s >= budget_s:
            s.stopped_by = "time budget"
            if self.world.is_main:
                log.info("train: the time budget (train.max_minutes: %g) was spent at step %d; "
                         "nothing to train. Raise train.max_minutes to continue the run.",
                         p.max_minutes, s.step)
            return self.summary()
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=p.steps, initial=s.step, desc="train", unit="step",
                       dynamic_ncols=True, mininterval=1.0)
        it = iter(self.loader)
        session_start, elapsed_at_start = time.perf_counter(), s.elapsed_s
        # The open log row's training seconds from before a resume count in its rate.
        last_ckpt_time, window_start = time.monotonic(), time.perf_counter() - self._window_s
        paused = 0.0  # validation and checkpoints in the window: not the training rate's
        self.model.train()
        try:
            while s.step < p.steps:
                self.train_step(self._micro_batches(it))
                self.heap.after_step(s.step)
                # Rank 0 decides (its clock), every rank follows: one collective per step.
                # Its elapsed time also sets the cooldown's lr, the same on every rank.
                due_time = (p.checkpoint_every_minutes and time.monotonic() - last_ckpt_time
                            >= 60 * p.checkpoint_every_minutes)
                due_steps = p.checkpoint_every_steps and s.step % p.checkpoint_every_steps == 0
                due, stop, s.elapsed_s = distributed.broadcast_values(
                    [bool(due_steps or due_time), should_stop(),
                     elapsed_at_start + time.perf_counter() - session_start],
                    self.device, self.world)
                out_of_time = s.elapsed_s >= budget_s
                finished = s.step == p.steps or out_of_time
                if self._logs_at(s.step) or out_of_time:
                    window = [a + b for a, b in zip(self._window, self._flush(), strict=True)]
                    now = time.perf_counter()
                    self._log_train_row(window, now - window_start - paused, bar)
                    self._window, window_start, paused = [0.0, 0.0, 0.0], now, 0.0
                bleu = bool(p.valid_bleu_every) and (s.step % p.valid_bleu_every == 0 or finished)
                validating = s.step % p.valid_every == 0 or finished or bleu
                saving = bool(due) or finished
                # their time goes into the next log row's window, and out of its rate
                between = time.perf_counter() if (validating or saving) and not finished else None
                if validating:
                    self._log_valid_row(bleu)
                if finished or saving or bool(stop):  # the validation's time is the run's
                    # too (bleu_seconds is counted inside elapsed_s), and a checkpoint holds
                    # it: a resumed run's time budget goes on from there. Rank 0's clock.
                    (s.elapsed_s,) = distributed.broadcast_values(
                        [elapsed_at_start + time.perf_counter() - session_start], self.device,
                        self.world)
                if bar is not None:
                    bar.update(1)
                if saving or (bool(stop) and not finished):
                    # the open log row's training time so far (resumed with it)
                    self._window_s = (between or time.perf_counter()) - window_start - paused
                if saving:
                    self.write_logs()
                    self.checkpoint()
                    last_ckpt_time = time.monotonic()
                if between is not None:
                    paused += time.perf_counter() - between
                if out_of_time:
                    s.stopped_by = "time budget"
                    if self.world.is_main:
                        log.info("train: time budget of %g min spent at step %d (%.1f min over "
                                 "all sessions); checkpoint written", p.max_minutes, s.step,
                                 s.elapsed_s / 60)
                    break
                if bool(stop):
                    if not finished:  # interrupted: keep every finished step
                        if not saving:  # (this step's checkpoint is written already)
                            self.write_logs()
                            self.checkpoint(interim=True)
                        s.stopped_by = "interrupted"
                        if self.world.is_main:
                            log.info("stopped at step %d; checkpoint written, run the same "
                                     "command again to resume", s.step)
                    break
            if s.step >= p.steps:
                s.stopped_by = "steps"
        except torch.OutOfMemoryError as exc:
            raise OutOfMemory(
                f"out of memory at step {s.step + 1} with micro-batches of up to "
                f"{self.plan.batch_tokens:,} tokens ({exc}); set train.max_tokens below that "
                "(train.tokens_per_step stays, accumulation grows; no data stage re-runs); "
                "training resumes from the last checkpoint") from None
        finally:
            if bar is not None:
                bar.close()
            self.loader.close()
        return self.summary()

    def _log_start(self) -> None:
        p = self.p.train
        log.info("train: %s parameters on %s, %s, %s kernels%s%s",
                 f"{count_parameters(self.model):,}", self.device,
                 f"{precision_name(self.amp_dtype)} autocast" if self.amp_dtype else "fp32",
                 p.kernels,
                 (", compiled" if p.compile else "")
                 + (f", subword split {p.subword_split:g}" if p.subword_split else "")
                 + (f", R-Drop alpha {p.rdrop:g}" if p.rdrop else ""),
                 f", time budget {p.max_minutes:g} min" if p.max_minutes else "")
        # what the budget holds once padding is counted: the plan's mean micro-batch
        real = (self.train_data.target_tokens() / self.train_data.num_batches
                * self.plan.world_size * self.plan.accumulation)
        log.info("train: %s, planned from %s: ~%s target tokens a step on average (the rest "
                 "is padding)", self.plan.describe(), self.paths.shards / "train",
                 f"{real:,.0f}")

    def summary(self) -> dict:
        s = self.state
        last_train = self.log.train[-1] if self.log.train else None
        last_valid = self.log.valid[-1] if self.log.valid else None
        return {
            "steps": s.step,
            "tokens_seen": s.tokens_seen,
            "wall_time_s": round(s.elapsed_s, 3),
            "tokens_per_s": s.tokens_seen / s.elapsed_s if s.elapsed_s else 0.0,
            "train_loss": last_train.loss if last_train else None,
            "train_nll": last_train.nll if last_train else None,
            "valid_loss": last_valid.valid_loss if last_valid else None,
            "valid_nll": last_valid.valid_nll if last_valid else None,
            "valid_ppl": last_valid.valid_ppl if last_valid else None,
            "parameters": count_parameters(self.model),
            "world_size": self.world.size,
            "accumulation": self.plan.accumulation,
            "batch_tokens": self.plan.batch_tokens,
            "device": self.device.type,
            "precision": precision_name(self.amp_dtype),
            **({"loss_scale": self.scaler.get_scale()} if self.scaler.is_enabled() else {}),
            **hardware(self.device),
            "kernels": self.p.train.kernels,
            "allocator": self.allocator,
            "output_vocab": self.cfg.output_vocab,
            "output_vocab_size": (self.cfg.vocab_size if self.output_vocab is None
                                  else int(self.output_vocab.ids.numel())),
            "compile": self.p.train.compile,
            "subword_split": self.p.train.subword_split,
            "rdrop": self.p.train.rdrop,
            "max_minutes": self.p.train.max_minutes,
            "stopped_by": s.stopped_by,
            **self.log.bleu_summary(s.bleu_seconds, s.elapsed_s),
        }

    def write_summary(self, summary: dict) -> None:
        if self.world.is_main:
            write_json(self.paths.metrics, summary)
