"""The training loop (Section 5): a plain loop around components built elsewhere.

:func:`aiayn.training.build.build_trainer` assembles the model, optimizer, criterion, batch
loader and run store (and resumes a run); :class:`Trainer` only steps, validates,
checkpoints and stops:

* one optimizer step takes ``plan.accumulation`` micro-batches per process
  (:mod:`aiayn.data.batching`); its loss is the sum over every target token of every
  micro-batch on every rank divided by their global count, so 1 process x 2 micro-batches
  and 2 processes x 1 compute the same update;
* loss sums and token counts stay on the device: the host waits for it only at logging,
  checkpoint and stop steps (:meth:`Trainer.flush`), never per micro-batch;
* the time budget, the log rows' windows and when a checkpoint is due are the clock's
  (:mod:`aiayn.training.clock`); rank 0 decides, every rank follows (one broadcast a step);
* checkpoints hold everything a resumed run needs to end bitwise where an unbroken one ends
  (CPU): model, optimizer, schedule, loss scale, data cursor, every rank's RNG state and the
  run log; the checkpoint folder's policy is the run store's (:mod:`aiayn.training.run_store`);
* log rows go to metrics/ and, as events, to the listeners the stage subscribes (MLflow:
  stages/train.py); the loop names no tracker.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from aiayn.config import Params
from aiayn.data.batching import StepPlan
from aiayn.data.sampler import Batch, ShardDataset, TokenBudgetSampler
from aiayn.errors import AiaynError, DataError
from aiayn.io import write_json
from aiayn.model import count_parameters
from aiayn.precision import hardware, no_autocast, precision_name, step_casts
from aiayn.training import distributed
from aiayn.training.clock import CheckpointPolicy, Clock
from aiayn.training.distributed import World
from aiayn.training.memory import HeapTrimmer
from aiayn.training.resume import gather_rng_states
from aiayn.training.run_log import RunLog, TrainRow, ValidRow
from aiayn.training.run_store import RunStore
from aiayn.training.schedule import end_independent, schedule_at, training_progress

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
    bleu_seconds: float = 0.0  # time spent in validation BLEU (inside elapsed_s)
    # the newest checkpoint whose steps no end of the run decided: taken at the full rate (no
    # cooldown) and before train.rdrop_start switched R-Drop on
    stable_step: int | None = None
    rdrop_from_step: int | None = None  # the first step train.rdrop_start gave R-Drop
    stopped_by: str | None = None  # "steps", "time budget" or "interrupted"
    # The open log row: [target tokens, loss sum, NLL sum] read since the last row and its
    # training seconds, saved with each checkpoint so that the row after a resume holds what
    # an unbroken run's would.
    window: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    window_s: float = 0.0
    # The step of a checkpoint written only to stop (Ctrl-C, SIGTERM), not by the rule: the
    # next checkpoint replaces it, so that a resumed run keeps an unbroken run's checkpoints.
    interim: set[int] = field(default_factory=set)


class TrainingListener:
    """What a listener hears from the loop (rank 0 only); each method does nothing here."""

    def on_train_row(self, row: TrainRow) -> None: ...

    def on_valid_row(self, row: ValidRow) -> None: ...

    def on_checkpoint(self, step: int, path: Path | None) -> None: ...


@torch.no_grad()
def validation_loss(model: nn.Module, criterion: Callable, data: ShardDataset, world: World,
                    device: torch.device, seed: int) -> dict:
    """The loss, NLL and perplexity per target token of ``data`` (every batch once, dealt
    to the ranks, summed over them), in eval mode."""
    model.eval()
    sampler = TokenBudgetSampler(data.num_batches, world.rank, world.size, seed=seed,
                                 shuffle=False)
    loss_sum = nll_sum = tokens = 0.0
    for index in sampler.epoch_iter():
        batch = data.batch(index)
        if batch.is_empty:
            continue
        loss, nll, n = criterion(model, batch.to(device))
        loss_sum, nll_sum = loss_sum + loss.item(), nll_sum + nll.item()
        tokens += int(n)
    loss_sum, nll_sum, tokens = distributed.all_sum([loss_sum, nll_sum, tokens], device, world)
    model.train()
    nll = nll_sum / max(tokens, 1)
    return {"valid_loss": loss_sum / max(tokens, 1), "valid_nll": nll,
            "valid_ppl": math.exp(min(nll, 50.0)), "tokens": int(tokens)}


@dataclass(kw_only=True)
class Trainer:
    """The loop over components built by :func:`aiayn.training.build.build_trainer`."""

    p: Params
    paths: TrainPaths
    world: World
    device: torch.device
    model: nn.Module
    net: nn.Module  # the model, or its DDP and/or compiled wrapper
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler  # fp16's loss scaling; a no-op in other precisions
    criterion: Callable
    amp_dtype: torch.dtype | None
    plan: StepPlan
    train_data: ShardDataset
    valid_data: ShardDataset
    loader: object  # PrefetchLoader: an endless stream of this rank's micro-batches
    store: RunStore
    checkpoint_meta: dict  # the fingerprint and identity every checkpoint carries
    heap: HeapTrimmer
    allocator: str
    state: RunState = field(default_factory=RunState)
    log: RunLog = field(default_factory=RunLog)
    valid_bleu: Callable | None = None  # (model, device, amp_dtype) -> score, on rank 0
    listeners: list[TrainingListener] = field(default_factory=list)
    progress: bool = True

    def __post_init__(self) -> None:
        self.progress = self.progress and self.world.is_main
        # Device-side sums of [target tokens, loss, NLL] since the last flush, from step:
        self._pending = torch.zeros(3, dtype=torch.float64, device=self.device)
        self._pending_from = self.state.step + 1
        self._grad_norm: torch.Tensor | None = None
        self._lr = 0.0

    def _emit(self, event: str, *args) -> None:
        if self.world.is_main:
            for listener in self.listeners:
                getattr(listener, event)(*args)

    # -- one optimizer step -----------------------------------------------------------

    def micro_batches(self, it: Iterator[Batch]) -> list[Batch]:
        return [next(it) for _ in range(self.plan.accumulation)]

    def _forward_loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, int]:
        if batch.is_empty:
            # An empty batch (the last round of an epoch) still runs a forward and backward
            # so that DDP's gradient all-reduce happens on every rank; its labels are all
            # padding, so it adds nothing.
            pad = self.model.cfg.pad_id
            one = torch.full((1, 1), pad, dtype=torch.long)
            none = torch.zeros(0, dtype=torch.long)
            batch = Batch(one, one, one, torch.zeros(1, dtype=torch.long), 0, 0,
                          tgt_positions=none)
        return self.criterion(self.net, batch.to(self.device, non_blocking=True))

    def train_step(self, batches: list[Batch]) -> None:
        """Accumulate gradients over this rank's micro-batches and take one Adam step; the
        step's token count and loss sums go to device-side totals (:meth:`flush`)."""
        self._switch_rdrop()
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
                with contextlib.nullcontext() if sync else self.net.no_sync():
                    loss, nll, _ = self._forward_loss(batch)
                    with no_autocast(device):
                        self.scaler.scale(loss * scale).backward()
                self._pending[1] += loss.detach()
                self._pending[2] += nll.detach()
        self._pending[0] += local_tokens
        t = self.p.train
        params = [q for q in self.model.parameters() if q.grad is not None]
        if self.scaler.is_enabled():  # the true gradients, for clipping, the norm and Adam
            self.scaler.unscale_(self.optimizer)
        if t.clip_norm > 0:
            self._grad_norm = torch.nn.utils.clip_grad_norm_(params, t.clip_norm)
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
        """train.cooldown's lr multiplier for the next step, from rank 0's clock, so every
        rank agrees (a budgeted run's rates depend on the machine's speed, as its last step
        already does)."""
        return self.schedule()["lr_factor"]

    def _switch_rdrop(self) -> None:
        """With train.rdrop_start, R-Drop trains the steps after that point of the run only
        (the criterion's ``active``; every rank decides alike, from rank 0's clock)."""
        t = self.p.train
        if not (t.rdrop > 0 and t.rdrop_start > 0):
            return
        on = self.schedule()["rdrop_started"]
        if on != self.criterion.active:
            self.criterion.active = on
            if on and self.state.rdrop_from_step is None:
                self.state.rdrop_from_step = self.state.step + 1
            if on and self.world.is_main:
                log.info("train: R-Drop on from step %d, %.0f%% of the run done "
                         "(train.rdrop_start %g)", self.state.step + 1,
                         100 * training_progress(t, self.state.step, self.state.elapsed_s),
                         t.rdrop_start)

    def schedule(self) -> dict:
        """:func:`schedule_at` for the next step, from rank 0's clock like the cooldown."""
        return schedule_at(self.p.train, self.state.step, self.state.elapsed_s)

    def _logs_at(self, step: int) -> bool:
        return step % self.p.train.log_every == 0 or step == self.p.train.steps

    def flush(self) -> tuple[float, float, float]:
        """Read (and zero) the device-side sums since the last flush, summed over ranks:
        (target tokens, loss sum, NLL sum). Every rank calls it at the same steps. A
        non-finite loss stops training here, before anything is logged or checkpointed,
        so every checkpoint on disk holds finite weights."""
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

    # -- validation, log rows, checkpoints ----------------------------------------------

    def validate(self) -> dict:
        return validation_loss(self.model, self.criterion, self.valid_data, self.world,
                               self.device, self.p.seed)

    def _valid_bleu(self) -> float | None:
        """Rank 0 translates and scores; the other ranks wait for it."""
        score = None
        if self.world.is_main and self.valid_bleu is not None:
            start = Clock.now()
            score = float(self.valid_bleu(self.model, self.device, self.amp_dtype))
            self.state.bleu_seconds += Clock.now() - start
        if self.world.distributed:
            torch.distributed.barrier()
        return score

    def _train_row(self, window: list[float], seconds: float, bar) -> None:
        s = self.state
        tokens, loss, nll = window
        row = TrainRow(step=s.step, loss=loss / max(tokens, 1), nll=nll / max(tokens, 1),
                       lr=self._lr,
                       grad_norm=(float(self._grad_norm) if self._grad_norm is not None
                                  else float("nan")),
                       tokens=s.tokens_seen, tokens_per_s=tokens / max(seconds, 1e-9),
                       elapsed_s=s.elapsed_s)
        self.log.train.append(row)
        self._emit("on_train_row", row)
        if bar is not None:
            bar.set_postfix(loss=f"{row.loss:.3f}", lr=f"{row.lr:.2e}",
                            tok_s=f"{row.tokens_per_s:,.0f}", refresh=False)

    def _valid_row(self, bleu: bool = False) -> None:
        row = ValidRow(step=self.state.step, **self.validate(),
                       valid_bleu=self._valid_bleu() if bleu else None)
        self.log.valid.append(row)
        self._emit("on_valid_row", row)
        if self.world.is_main:
            log.info("step %d: valid loss %.4f, nll %.4f, ppl %.2f%s", row.step, row.valid_loss,
                     row.valid_nll, row.valid_ppl,
                     "" if row.valid_bleu is None else f", sacreBLEU {row.valid_bleu:.2f}")

    def write_logs(self) -> None:
        if self.world.is_main:
            self.log.write(self.paths.train_log, self.paths.valid_log, self.paths.valid_bleu_log)

    def checkpoint(self, interim: bool = False) -> Path | None:
        """Save the run (every rank calls it: it is collective). ``interim``: a checkpoint
        only to stop at a step the rule did not choose; the next checkpoint replaces it."""
        s, t = self.state, self.p.train
        # refuses to write after a non-finite loss; the sums go on in the open log row
        s.window = [a + b for a, b in zip(s.window, self.flush(), strict=True)]
        rngs = gather_rng_states(self.world)
        schedule = self.schedule()  # the next step's, under the end that made this one
        if end_independent(schedule):
            s.stable_step = s.step
        if not self.world.is_main:
            return None
        state = checkpoint_state(self, rngs, interim, schedule)
        # train.average "best": the best-BLEU checkpoints stay for the average stage (it may
        # try up to max(train.average_candidates) of them); with a cooldown, the last
        # checkpoint before it stays: a run whose end moves later goes on from there.
        wanted = max(t.average_candidates or [t.average_last])
        protect = self.log.best_bleu_steps(wanted) if t.average == "best" else set()
        if (t.cooldown > 0 or t.rdrop_start > 0) and s.stable_step is not None:
            protect |= {s.stable_step}
        replaced, s.interim = s.interim - {s.step}, {s.step} if interim else set()
        path = self.store.save(s.step, state, t.keep_checkpoints, protect, replaced)
        self._emit("on_checkpoint", s.step, path)
        return path

    # -- the run --------------------------------------------------------------------------

    def fit(self, should_stop: Callable[[], bool] = lambda: False) -> dict:
        """Train until train.steps, the time budget or a stop request, whichever comes first;
        returns :meth:`summary`."""
        p, s = self.p.train, self.state
        clock = Clock(s.elapsed_s, p.max_minutes, s.window_s)
        if self.world.is_main:
            log_plan(self)
        if s.step < p.steps and clock.spent(s.elapsed_s):
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
        policy = CheckpointPolicy(p.checkpoint_every_steps, p.checkpoint_every_minutes)
        self.model.train()
        try:
            while s.step < p.steps:
                self.train_step(self.micro_batches(it))
                self.heap.after_step(s.step)
                # Rank 0 decides (its clock), every rank follows: one collective per step.
                # Its elapsed time also sets the cooldown's lr, the same on every rank.
                due, stop, s.elapsed_s = distributed.broadcast_values(
                    [policy.due(s.step), should_stop(), clock.elapsed()], self.device,
                    self.world)
                out_of_time = clock.spent(s.elapsed_s)
                finished = s.step == p.steps or out_of_time
                if self._logs_at(s.step) or out_of_time:
                    window = [a + b for a, b in zip(s.window, self.flush(), strict=True)]
                    self._train_row(window, clock.close_window(), bar)
                    s.window = [0.0, 0.0, 0.0]
                bleu = bool(p.valid_bleu_every) and (s.step % p.valid_bleu_every == 0 or finished)
                validating = s.step % p.valid_every == 0 or finished or bleu
                saving = bool(due) or finished
                if (validating or saving) and not finished:
                    clock.pause()  # its time goes into the run's, not the window's rate
                if validating:
                    self._valid_row(bleu)
                if finished or saving or bool(stop):  # the validation's time is the run's
                    # too (bleu_seconds is inside elapsed_s), and a checkpoint holds it: a
                    # resumed run's budget goes on from there. Rank 0's clock.
                    (s.elapsed_s,) = distributed.broadcast_values([clock.elapsed()],
                                                                  self.device, self.world)
                if bar is not None:
                    bar.update(1)
                if saving or (bool(stop) and not finished):
                    s.window_s = clock.window_s()  # the open row's training time (resumed)
                if saving:
                    self.write_logs()
                    self.checkpoint()
                    policy.saved()
                clock.resume()
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

    def summary(self) -> dict:
        return run_summary(self)

    def write_summary(self, summary: dict) -> None:
        if self.world.is_main:
            write_json(self.paths.metrics, summary)


def checkpoint_state(trainer: Trainer, rngs: list[dict], interim: bool, schedule: dict) -> dict:
    """What a checkpoint holds: everything a resumed run needs to end where an unbroken one
    ends, and the meta the run store and the average stage read (``schedule``: what the end
    that made this one decides for the next step, :func:`schedule_at`)."""
    s, t, log_ = trainer.state, trainer.p.train, trainer.log
    return {
        "model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "scaler": trainer.scaler.state_dict(),  # {} unless fp16
        "data": trainer.loader.state_dict(), "rng": rngs,
        "run": {"step": s.step, "tokens_seen": s.tokens_seen, "elapsed_s": s.elapsed_s,
                **log_.to_saved(), "window": list(s.window), "window_s": s.window_s,
                "bleu_seconds": s.bleu_seconds, "stable_step": s.stable_step,
                "rdrop_from_step": s.rdrop_from_step},
        "meta": {**trainer.checkpoint_meta, "step": s.step, "tokens_seen": s.tokens_seen,
                 "world_size": trainer.world.size, "batch_tokens": trainer.plan.batch_tokens,
                 "valid_bleu": log_.bleu_at(s.step), "interim": interim,
                 "schedule": {"steps": t.steps, "max_minutes": t.max_minutes, **schedule}},
    }


def log_plan(trainer: Trainer) -> None:
    """The run's first lines: the model, device, precision and kernels; the step's plan."""
    t, p = trainer, trainer.p.train
    log.info("train: %s parameters on %s, %s, %s kernels%s%s",
             f"{count_parameters(t.model):,}", t.device,
             f"{precision_name(t.amp_dtype)} autocast" if t.amp_dtype else "fp32", p.kernels,
             (", compiled" if p.compile else "")
             + (f", subword split {p.subword_split:g}" if p.subword_split else "")
             + (f", R-Drop alpha {p.rdrop:g}" if p.rdrop else "")
             + (f" on {p.rdrop_fraction:.0%} of each batch's sentences"
                if p.rdrop and p.rdrop_fraction < 1 else "")
             + (f" from {p.rdrop_start:.0%} of the run" if p.rdrop and p.rdrop_start else ""),
             f", time budget {p.max_minutes:g} min" if p.max_minutes else "")
    # what the budget holds once padding is counted: the plan's mean micro-batch
    real = (t.train_data.target_tokens() / t.train_data.num_batches
            * t.plan.world_size * t.plan.accumulation)
    log.info("train: %s, planned from %s: ~%s target tokens a step on average (the rest is "
             "padding)", t.plan.describe(), t.paths.shards / "train", f"{real:,.0f}")


def run_summary(trainer: Trainer) -> dict:
    """metrics/train.json: where the run ended, its last losses, and what it ran on."""
    s, t, cfg = trainer.state, trainer.p.train, trainer.model.cfg
    last_train = trainer.log.train[-1] if trainer.log.train else None
    last_valid = trainer.log.valid[-1] if trainer.log.valid else None
    output_vocab = trainer.model.output_vocab()
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
        "parameters": count_parameters(trainer.model),
        "world_size": trainer.world.size,
        "accumulation": trainer.plan.accumulation,
        "batch_tokens": trainer.plan.batch_tokens,
        "device": trainer.device.type,
        "precision": precision_name(trainer.amp_dtype),
        **({"loss_scale": trainer.scaler.get_scale()} if trainer.scaler.is_enabled() else {}),
        **hardware(trainer.device),
        "kernels": t.kernels,
        "allocator": trainer.allocator,
        "output_vocab": cfg.output_vocab,
        "output_vocab_size": (cfg.vocab_size if output_vocab is None
                              else int(output_vocab.ids.numel())),
        "compile": t.compile,
        "subword_split": t.subword_split,
        "rdrop": t.rdrop,
        "rdrop_start": t.rdrop_start,
        "rdrop_fraction": t.rdrop_fraction,
        # the first step trained with R-Drop (None: none was): where a plot counts passes twice
        "rdrop_from_step": (s.rdrop_from_step if t.rdrop_start else 1) if t.rdrop else None,
        "max_minutes": t.max_minutes,
        "stopped_by": s.stopped_by,
        **trainer.log.bleu_summary(s.bleu_seconds, s.elapsed_s),
    }
