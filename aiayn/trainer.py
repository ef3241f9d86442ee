"""The training loop (Section 5): a plain loop around small components.

* batches: the shard stage's token-budget batches, dealt to ranks by TokenBudgetSampler;
* one optimizer step sees ``train.tokens_per_step`` target tokens (capacity) whatever the
  world size: accumulation = ceil(tokens_per_step / (world_size * shard.max_tokens));
* the loss of a step is the sum over every target token of every micro-batch on every
  rank divided by their global count, so 1 process x 2 accumulation steps and 2 processes
  x 1 step compute the same update;
* checkpoints (aiayn.checkpoint) every N steps and/or T minutes hold the model, optimizer,
  scheduler, every RNG state, the data cursor and the logs, so a killed run resumes and
  ends bitwise where an uninterrupted one ends (CPU);
* metrics go to metrics/ (git, DVC plots) and, from rank 0, to MLflow (aiayn.tracking).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import random
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from aiayn import distributed
from aiayn.checkpoint import file_sha256, latest_checkpoint, save_checkpoint
from aiayn.config import Params
from aiayn.distributed import World
from aiayn.errors import AiaynError, DataError
from aiayn.io import atomic_path, write_json
from aiayn.memory import HeapTrimmer
from aiayn.model import Transformer, TransformerConfig, count_parameters
from aiayn.objective import label_smoothed_loss, make_optimizer
from aiayn.precision import autocast_dtype, slow_bf16_warning
from aiayn.sampler import Batch, BatchLoader, ShardDataset, TokenBudgetSampler

log = logging.getLogger("aiayn")

TRAIN_LOG_COLUMNS = ("step", "loss", "nll", "lr", "grad_norm", "tokens", "tokens_per_s",
                     "elapsed_s")
VALID_LOG_COLUMNS = ("step", "valid_loss", "valid_nll", "valid_ppl", "tokens")


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


@dataclass
class RunState:
    """Everything besides model and optimizer that a resumed run needs."""

    step: int = 0
    tokens_seen: int = 0
    elapsed_s: float = 0.0  # training wall time summed over all sessions of this run
    train_rows: list[list[float]] = field(default_factory=list)
    valid_rows: list[list[float]] = field(default_factory=list)
    mlflow_run_id: str | None = None


def model_config(p: Params, vocab_size: int) -> TransformerConfig:
    m = p.model
    return TransformerConfig(
        vocab_size=vocab_size, d_model=m.d_model, heads=m.heads, encoder_layers=m.encoder_layers,
        decoder_layers=m.decoder_layers, d_ff=m.d_ff, dropout=m.dropout,
        attention_dropout=p.train.attention_dropout,
        activation_dropout=p.train.activation_dropout, norm=m.norm,
        max_positions=m.max_positions)


def pick_device(choice: str, world: World) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise AiaynError("train.device is 'cuda' but no GPU is visible; set train.device: "
                             "auto or cpu")
        torch.cuda.set_device(world.local_rank)
        return torch.device("cuda", world.local_rank)
    return torch.device("cpu")


def accumulation_steps(tokens_per_step: int, world_size: int, max_tokens: int) -> int:
    return max(1, math.ceil(tokens_per_step / (world_size * max_tokens)))


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
    def __init__(self, p: Params, vocab_size: int, tokenizer_sha256: str, paths: TrainPaths,
                 world: World, tracker=None, progress: bool = True):
        self.p, self.paths, self.world, self.tracker = p, paths, world, tracker
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

        torch.manual_seed(p.seed)  # identical initial weights on every rank
        self.model = Transformer(self.cfg).to(self.device)
        self.optimizer, self.scheduler = make_optimizer(
            self.model, p.train.adam_betas, p.train.adam_eps, p.model.d_model,
            p.train.warmup_steps, p.train.lr_scale)

        self.train_data = ShardDataset(paths.shards / "train")
        self.valid_data = ShardDataset(paths.shards / "valid")
        self._check_vocab(vocab_size)
        self.sampler = TokenBudgetSampler(self.train_data.num_batches, world.rank, world.size,
                                          seed=p.seed)
        self.loader = BatchLoader(self.train_data, self.sampler)
        # Varied batch shapes fragment glibc's heap on CPU; trimming keeps RSS flat.
        self.heap = HeapTrimmer(enabled=self.device.type == "cpu")
        self.accum = accumulation_steps(p.train.tokens_per_step, world.size,
                                        int(self.train_data.meta["max_tokens"]))
        self.state = RunState()
        self.identity = self.run_identity()
        self._resume()
        # Dropout differs between ranks; the seed offset keeps it reproducible per rank.
        if self.state.step == 0:
            torch.manual_seed(p.seed + 1 + world.rank)
        self.net: nn.Module = self.model
        if p.train.compile:
            self.net = torch.compile(self.net)
        if world.distributed:
            self.net = nn.parallel.DistributedDataParallel(
                self.net, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    # -- setup helpers ----------------------------------------------------------------

    def _check_vocab(self, vocab_size: int) -> None:
        for ds, name in ((self.train_data, "train"), (self.valid_data, "valid")):
            if int(ds.meta["vocab_size"]) != vocab_size:
                raise DataError(
                    f"{self.paths.shards / name}/meta.json: shards were made with a vocabulary "
                    f"of {ds.meta['vocab_size']} tokens, the tokenizer has {vocab_size}; re-run "
                    "`aiayn survey` and `aiayn shard` (or `dvc repro`)")

    def run_identity(self) -> dict:
        """Every setting that shapes the computation of the steps already taken.

        A checkpoint resumes only if all of these are unchanged. Left out on purpose: the
        number of steps (the schedule does not depend on it, so extending a finished run
        equals a longer fresh one), logging and checkpoint cadence, device, compilation,
        and the process count (a resumed run may move to more GPUs; see _resume).
        """
        ignored = {"steps", "log_every", "valid_every", "checkpoint_every_steps",
                   "checkpoint_every_minutes", "keep_checkpoints", "average_last",
                   "nproc_per_node", "device", "compile"}
        identity = {"seed": self.p.seed, "vocab_size": self.fingerprint["vocab_size"],
                    "tokenizer_sha256": self.fingerprint["tokenizer_sha256"]}
        identity.update({f"model.{k}": v for k, v in self.cfg.to_dict().items()})
        identity.update({f"train.{k}": v for k, v in self.p.train.model_dump(mode="json").items()
                         if k not in ignored})
        digest = hashlib.sha256()
        for split in ("train", "valid"):
            for name in ("meta.json", "batches.npy", "rows.npy"):
                digest.update(file_sha256(self.paths.shards / split / name).encode())
        identity["shards_sha256"] = digest.hexdigest()
        return identity

    def _set_aside(self, changes: list[str]) -> None:
        """Move a run made with other settings out of the way (never delete it)."""
        folder = self.paths.checkpoints
        dest = folder.with_name(folder.name + ".replaced") / time.strftime("%Y%m%d-%H%M%S")
        if self.world.is_main:
            dest.mkdir(parents=True, exist_ok=True)
            for item in sorted(folder.iterdir()):
                shutil.move(str(item), str(dest / item.name))
            log.warning("train: the run in %s was made with other settings (%s); it does not "
                        "resume. Its files were moved to %s (delete them when no longer "
                        "needed) and a new run starts.", folder, "; ".join(changes), dest)
        if self.world.distributed:
            torch.distributed.barrier()

    def _resume(self) -> None:
        found = latest_checkpoint(self.paths.checkpoints, map_location=self.device)
        if found is None:
            return
        path, ckpt = found
        saved, now = ckpt["meta"].get("identity") or {}, self.identity
        if saved != now:
            changes = [f"{k}: {saved.get(k, '(absent)')!r} -> {now.get(k, '(absent)')!r}"
                       for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
            self._set_aside(changes)
            return
        if ckpt["meta"].get("world_size") != self.world.size:
            log.warning("resuming a run made with %s processes on %d: the data order changes "
                        "from here on", ckpt["meta"].get("world_size"), self.world.size)
            ckpt["data"] = None
        self.model.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        if ckpt["data"] is not None:
            self.loader.load_state_dict(ckpt["data"])
        run = ckpt["run"]
        self.state = RunState(step=run["step"], tokens_seen=run["tokens_seen"],
                              elapsed_s=run["elapsed_s"], train_rows=run["train_rows"],
                              valid_rows=run["valid_rows"],
                              mlflow_run_id=ckpt["meta"].get("mlflow_run_id"))
        rngs = ckpt["rng"]
        set_rng_state(rngs[self.world.rank] if self.world.rank < len(rngs) else rngs[0])
        log.info("resumed from %s (step %d, %d target tokens seen)", path, self.state.step,
                 self.state.tokens_seen)

    # -- one optimizer step -----------------------------------------------------------

    def _micro_batches(self, it: Iterator[Batch]) -> list[Batch]:
        return [next(it) for _ in range(self.accum)]

    def _forward_loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, int]:
        if batch.is_empty:
            # An empty batch (the last round of an epoch) still runs a forward and backward
            # so that DDP's gradient all-reduce happens on every rank; its labels are all
            # padding, so it adds nothing.
            pad = self.cfg.pad_id
            one = torch.full((1, 1), pad, dtype=torch.long)
            batch = Batch(one, one, one, torch.zeros(1, dtype=torch.long), 0, 0)
        batch = batch.to(self.device, non_blocking=True)
        with torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32,
                            enabled=self.amp_dtype is not None):
            logits = self.net(batch.src, batch.tgt_in)
        return label_smoothed_loss(logits, batch.tgt_out, self.p.train.label_smoothing,
                                   self.cfg.pad_id)

    def train_step(self, batches: list[Batch]) -> dict:
        """Accumulate gradients over this rank's micro-batches and take one Adam step."""
        local_tokens = sum(b.tgt_tokens for b in batches)
        (global_tokens,) = distributed.all_sum([local_tokens], self.device, self.world)
        if global_tokens == 0:
            raise DataError("an optimizer step got no target tokens; the shards are empty?")
        # DDP averages gradients over ranks; multiplying by world size makes the step's
        # gradient the sum over all tokens divided by their global count.
        scale = self.world.size / global_tokens
        loss_sum = nll_sum = 0.0
        for i, batch in enumerate(batches):
            sync = i == len(batches) - 1 or not self.world.distributed
            ctx = contextlib.nullcontext() if sync else self.net.no_sync()
            with ctx:
                loss, nll, _ = self._forward_loss(batch)
                (loss * scale).backward()
            loss_sum += loss.item()
            nll_sum += nll.item()
        loss_sum, nll_sum = distributed.all_sum([loss_sum, nll_sum], self.device, self.world)
        loss = loss_sum / global_tokens
        if not math.isfinite(loss):
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainingDiverged(
                f"the training loss became {loss} at step {self.state.step + 1}; nothing was "
                f"written for this step, the last good checkpoint is in "
                f"{self.paths.checkpoints}. Lower train.lr_scale, raise train.warmup_steps or "
                "set train.clip_norm, then run again (it resumes from that checkpoint)")
        max_norm = self.p.train.clip_norm if self.p.train.clip_norm > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        self.state.tokens_seen += int(global_tokens)
        return {"loss": loss, "nll": nll_sum / global_tokens, "lr": lr, "grad_norm": grad_norm,
                "tokens": int(global_tokens)}

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
            batch = batch.to(self.device)
            with torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32,
                                enabled=self.amp_dtype is not None):
                logits = self.model(batch.src, batch.tgt_in)
            loss, nll, n = label_smoothed_loss(logits, batch.tgt_out,
                                               self.p.train.label_smoothing, self.cfg.pad_id)
            loss_sum, nll_sum, tokens = loss_sum + loss.item(), nll_sum + nll.item(), tokens + n
        loss_sum, nll_sum, tokens = distributed.all_sum([loss_sum, nll_sum, tokens],
                                                        self.device, self.world)
        self.model.train()
        nll = nll_sum / max(tokens, 1)
        return {"valid_loss": loss_sum / max(tokens, 1), "valid_nll": nll,
                "valid_ppl": math.exp(min(nll, 50.0)), "tokens": int(tokens)}

    # -- checkpoints and logs ---------------------------------------------------------------

    def _gather_rng(self) -> list[dict]:
        """Every rank's RNG state, so that each rank's dropout resumes exactly."""
        mine = rng_state()
        if not self.world.distributed:
            return [mine]
        gathered: list = [None] * self.world.size
        torch.distributed.all_gather_object(gathered, mine)
        return gathered

    def checkpoint(self) -> Path | None:
        rngs = self._gather_rng()  # collective: every rank calls it
        if not self.world.is_main:
            return None
        s = self.state
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "data": self.loader.state_dict(),
            "rng": rngs,
            "run": {"step": s.step, "tokens_seen": s.tokens_seen, "elapsed_s": s.elapsed_s,
                    "train_rows": s.train_rows, "valid_rows": s.valid_rows},
            "meta": {**self.fingerprint, "identity": self.identity,
                     "mlflow_run_id": s.mlflow_run_id, "step": s.step,
                     "tokens_seen": s.tokens_seen, "world_size": self.world.size},
        }
        path = save_checkpoint(self.paths.checkpoints, s.step, state,
                               keep=self.p.train.keep_checkpoints)
        return path

    def write_logs(self) -> None:
        if not self.world.is_main:
            return
        for path, columns, rows in ((self.paths.train_log, TRAIN_LOG_COLUMNS,
                                     self.state.train_rows),
                                    (self.paths.valid_log, VALID_LOG_COLUMNS,
                                     self.state.valid_rows)):
            lines = ["\t".join(columns)] + ["\t".join(_fmt(v) for v in row) for row in rows]
            with atomic_path(path) as tmp:
                tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")

    def _track(self, metrics: dict, step: int) -> None:
        if self.tracker is not None and self.world.is_main:
            self.tracker.log_metrics(metrics, step=step)

    # -- the run --------------------------------------------------------------------------

    def fit(self, should_stop: Callable[[], bool] = lambda: False) -> dict:
        p, s = self.p.train, self.state
        if self.world.is_main:
            log.info("train: %s parameters, %d process(es) on %s, %s, accumulation %d "
                     "(<= %d tokens per batch, %d per step)", f"{count_parameters(self.model):,}",
                     self.world.size, self.device, "bf16 autocast" if self.amp_dtype else "fp32",
                     self.accum, int(self.train_data.meta["max_tokens"]), p.tokens_per_step)
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=p.steps, initial=s.step, desc="train", unit="step",
                       dynamic_ncols=True, mininterval=1.0)
        it = iter(self.loader)
        session_start = time.perf_counter()
        elapsed_at_start = s.elapsed_s
        last_ckpt_time, window_tokens, window_start = time.monotonic(), 0, time.perf_counter()
        window_loss = window_nll = 0.0
        window_steps = 0
        self.model.train()
        try:
            while s.step < p.steps:
                stats = self.train_step(self._micro_batches(it))
                self.heap.after_step(s.step)
                s.elapsed_s = elapsed_at_start + time.perf_counter() - session_start
                window_tokens += stats["tokens"]
                window_loss += stats["loss"] * stats["tokens"]
                window_nll += stats["nll"] * stats["tokens"]
                window_steps += 1
                if s.step % p.log_every == 0 or s.step == p.steps:
                    now = time.perf_counter()
                    tps = window_tokens / max(now - window_start, 1e-9)
                    row = [s.step, window_loss / window_tokens, window_nll / window_tokens,
                           stats["lr"], stats["grad_norm"], s.tokens_seen, tps, s.elapsed_s]
                    s.train_rows.append(row)
                    self._track({"train/loss": row[1], "train/nll": row[2], "train/lr": row[3],
                                 "train/grad_norm": row[4], "train/tokens_per_s": tps}, s.step)
                    if bar is not None:
                        bar.set_postfix(loss=f"{row[1]:.3f}", lr=f"{row[3]:.2e}",
                                        tok_s=f"{tps:,.0f}", refresh=False)
                    window_tokens = window_steps = 0
                    window_loss = window_nll = 0.0
                    window_start = now
                if s.step % p.valid_every == 0 or s.step == p.steps:
                    v = self.validate()
                    s.valid_rows.append([s.step, v["valid_loss"], v["valid_nll"], v["valid_ppl"],
                                         v["tokens"]])
                    self._track({"valid/loss": v["valid_loss"], "valid/nll": v["valid_nll"],
                                 "valid/ppl": v["valid_ppl"]}, s.step)
                    if self.world.is_main:
                        log.info("step %d: valid loss %.4f, nll %.4f, ppl %.2f", s.step,
                                 v["valid_loss"], v["valid_nll"], v["valid_ppl"])
                if bar is not None:
                    bar.update(1)
                due_steps = p.checkpoint_every_steps and s.step % p.checkpoint_every_steps == 0
                due_time = (p.checkpoint_every_minutes
                            and time.monotonic() - last_ckpt_time
                            >= 60 * p.checkpoint_every_minutes)
                due = distributed.broadcast_flag(bool(due_steps or due_time), self.device,
                                                 self.world)
                if due or s.step == p.steps:
                    self.write_logs()
                    self.checkpoint()
                    last_ckpt_time = time.monotonic()
                if distributed.broadcast_flag(should_stop(), self.device, self.world):
                    if s.step < p.steps:  # interrupted: keep every finished step
                        self.write_logs()
                        self.checkpoint()
                        if self.world.is_main:
                            log.info("stopped at step %d; checkpoint written, run the same "
                                     "command again to resume", s.step)
                    break
        except torch.OutOfMemoryError as exc:
            raise OutOfMemory(
                f"out of memory at step {s.step + 1} with batches of up to "
                f"{self.train_data.meta['max_tokens']} tokens ({exc}); lower shard.max_tokens "
                "and re-run the shard stage (train.tokens_per_step stays, accumulation grows); "
                "training resumes from the last checkpoint") from None
        finally:
            if bar is not None:
                bar.close()
        return self.summary()

    def summary(self) -> dict:
        s = self.state
        last_train = s.train_rows[-1] if s.train_rows else None
        last_valid = s.valid_rows[-1] if s.valid_rows else None
        return {
            "steps": s.step,
            "tokens_seen": s.tokens_seen,
            "wall_time_s": round(s.elapsed_s, 3),
            "tokens_per_s": s.tokens_seen / s.elapsed_s if s.elapsed_s else 0.0,
            "train_loss": last_train[1] if last_train else None,
            "train_nll": last_train[2] if last_train else None,
            "valid_loss": last_valid[1] if last_valid else None,
            "valid_nll": last_valid[2] if last_valid else None,
            "valid_ppl": last_valid[3] if last_valid else None,
            "parameters": count_parameters(self.model),
            "world_size": self.world.size,
            "accumulation": self.accum,
            "device": self.device.type,
            "precision": "bf16" if self.amp_dtype else "fp32",
        }

    def write_summary(self, summary: dict) -> None:
        if self.world.is_main:
            write_json(self.paths.metrics, summary)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)
