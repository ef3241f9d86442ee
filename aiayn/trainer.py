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
* ``train.max_minutes`` is a time budget over all sessions of a run: when it is spent the
  run validates, writes a checkpoint and stops (as fairseq's --stop-time-hours);
* with ``train.cooldown``, a run whose end (``train.steps``, ``train.max_minutes``) changes
  after its cooldown began goes on from its last checkpoint before the cooldown, which is
  kept for that: a longer run is the run it would have been from scratch (the
  warmup-stable-decay branching of Hagele et al. 2024);
* ``train.kernels: fast`` computes the same step with aiayn.kernels (fused output-projection
  loss, cheap dropout masks) and fused Adam; ``plain`` with torch's own operators;
* the next batches are read by a background thread (pinned for a GPU), and loss sums and
  token counts stay on the device: the host waits for the device only at logging,
  checkpoint and stop steps, never per micro-batch;
* every ``train.valid_bleu_every`` steps rank 0 translates the valid set through a hook
  (aiayn.translation.ValidationBleu) and scores sacreBLEU, while the other ranks wait;
* metrics go to metrics/ (git, DVC plots) and, from rank 0, to MLflow (aiayn.tracking).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import os
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
from aiayn.checkpoint import (
    checkpoint_step,
    file_sha256,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    mirror_checkpoints,
    progress_folder,
    save_checkpoint,
    unsaved_checkpoints,
)
from aiayn.config import Params, TrainConfig, shapes_training
from aiayn.distributed import World
from aiayn.errors import AiaynError, DataError, OutputError
from aiayn.io import atomic_path, free_bytes, human_bytes, write_json
from aiayn.kernels import projected_label_smoothed_loss
from aiayn.memory import HeapTrimmer
from aiayn.model import (
    Packing,
    Transformer,
    TransformerConfig,
    avoid_cudnn_attention,
    count_parameters,
)
from aiayn.objective import cooldown_factor, label_smoothed_loss, make_optimizer
from aiayn.precision import autocast_dtype, hardware, no_autocast, slow_bf16_warning, step_casts
from aiayn.sampler import Batch, BatchLoader, PrefetchLoader, ShardDataset, TokenBudgetSampler
from aiayn.subword import SubwordSplitter, split_closure

log = logging.getLogger("aiayn")

TRAIN_LOG_COLUMNS = ("step", "loss", "nll", "lr", "grad_norm", "tokens", "tokens_per_s",
                     "elapsed_s")
VALID_LOG_COLUMNS = ("step", "valid_loss", "valid_nll", "valid_ppl", "tokens", "valid_bleu")


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
    """Everything besides model and optimizer that a resumed run needs."""

    step: int = 0
    tokens_seen: int = 0
    elapsed_s: float = 0.0  # training wall time summed over all sessions of this run
    train_rows: list[list[float]] = field(default_factory=list)
    valid_rows: list[list[float | None]] = field(default_factory=list)  # BLEU None: not run
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
        max_positions=m.max_positions, output_vocab=m.output_vocab)


def pick_device(choice: str, world: World) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise AiaynError("train.device is 'cuda' but no GPU is visible; set train.device: "
                             "auto or cpu")
        torch.cuda.set_device(world.local_rank)
        device = torch.device("cuda", world.local_rank)
        avoid_cudnn_attention(device)
        return device
    return torch.device("cpu")


def lr_multiplier(t: TrainConfig, step: int, elapsed_s: float) -> float:
    """train.cooldown's lr multiplier for the step after ``step`` steps and ``elapsed_s``
    seconds of training: how much is done is the steps taken of train.steps, or the time
    spent of train.max_minutes if further on."""
    progress = step / t.steps
    if t.max_minutes:
        progress = max(progress, elapsed_s / (60 * t.max_minutes))
    return cooldown_factor(progress, t.cooldown)


def accumulation_steps(tokens_per_step: int, world_size: int, max_tokens: int) -> int:
    return max(1, math.ceil(tokens_per_step / (world_size * max_tokens)))


@dataclass(frozen=True)
class OutputVocab:
    """``model.output_vocab: target`` for the loss: the token ids the softmax spans
    (ascending, on the device), each token's column among them (-1: not spanned), and the
    padding id's column (the loss's pad label)."""

    ids: torch.Tensor
    column: torch.Tensor
    pad: int

    @classmethod
    def of(cls, ids: torch.Tensor, vocab_size: int, pad_id: int) -> OutputVocab:
        ids = ids.long()
        column = torch.full((vocab_size,), -1, dtype=torch.long, device=ids.device)
        column[ids] = torch.arange(ids.numel(), device=ids.device)
        pad = int(column[pad_id])
        if pad < 0:
            raise ValueError(f"the output vocabulary must hold the padding id {pad_id}")
        return cls(ids, column, pad)


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


def batch_loss(net: nn.Module, embedding: torch.Tensor, batch: Batch, label_smoothing: float,
               pad_id: int, fast: bool, amp_dtype: torch.dtype | None,
               output: OutputVocab | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, int | torch.Tensor]:
    """(smoothed loss sum, NLL sum, labels) of ``net`` (the model, or its compiled or DDP
    wrapper, whose shared embedding matrix is ``embedding``) on a batch already on the
    device: the plain kernels (full logits, ``label_smoothed_loss``) or the fast ones (a
    decoder without padding, the tied projection inside ``projected_label_smoothed_loss``).
    With ``output`` (model.output_vocab: target) the softmax, and label smoothing's uniform
    share, span its tokens only: the fast path projects onto their rows of the matrix, the
    plain one keeps their columns of the full logits."""
    device = batch.src.device.type
    labels, label_pad = batch.tgt_out, pad_id
    if output is not None:
        labels, label_pad = output.column[batch.tgt_out], output.pad
    with torch.autocast(device, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
        if fast:
            positions = batch.tgt_positions
            if positions is None:
                positions = Packing.positions(batch.tgt_out, pad_id)
            rows = net(batch.src, batch.tgt_in, packed=positions)
            weight = embedding if output is None else embedding.index_select(0, output.ids)
            return projected_label_smoothed_loss(rows, weight, labels, label_smoothing,
                                                 label_pad, positions=positions)
        logits = net(batch.src, batch.tgt_in)
        if output is not None:
            logits = logits.index_select(-1, output.ids)
    return label_smoothed_loss(logits, labels, label_smoothing, label_pad)


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
                 world: World, tracker=None, progress: bool = True,
                 valid_bleu: Callable[..., float] | None = None,
                 merges: np.ndarray | None = None):
        """``valid_bleu(model, device, amp_dtype) -> score`` is called by rank 0 every
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
        self.model = Transformer(self.cfg, fast=self.fast).to(self.device)
        self.optimizer, self.scheduler = make_optimizer(
            self.model, p.train.adam_betas, p.train.adam_eps, p.model.d_model,
            p.train.warmup_steps, p.train.lr_scale, fused=self.fast)

        if world.is_main:
            self._check_room_for_checkpoints()
        self.train_data = ShardDataset(paths.shards / "train")
        self.valid_data = ShardDataset(paths.shards / "valid")
        self._check_vocab(vocab_size)
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
        self.output_vocab: OutputVocab | None = None  # set after _resume, from the model
        # Varied batch shapes fragment glibc's heap on CPU; trimming keeps RSS flat.
        self.heap = HeapTrimmer(enabled=self.device.type == "cpu")
        self.accum = accumulation_steps(p.train.tokens_per_step, world.size,
                                        int(self.train_data.meta["max_tokens"]))
        self.state = RunState()
        # Device-side sums of [target tokens, loss, NLL] since the last flush (_flush).
        self._pending = torch.zeros(3, dtype=torch.float64, device=self.device)
        self._pending_from = 1  # first step the pending sums cover
        self._grad_norm: torch.Tensor | None = None
        self._lr = 0.0
        self.branched_from: dict | None = None  # set by _branch_point
        self._mirroring = True  # hard links in checkpoints.progress (_mirror)
        self.identity = self.run_identity()
        self._resume()
        if (ids := self.model.output_ids()) is not None:
            self.output_vocab = OutputVocab.of(ids, vocab_size, self.cfg.pad_id)
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

    # -- setup helpers ----------------------------------------------------------------

    def _check_room_for_checkpoints(self) -> None:
        """Fail before training, not at its first checkpoint, where one cannot fit."""
        weights = sum(q.numel() * q.element_size() for q in self.model.parameters())
        needed = 3 * weights  # the weights and Adam's two moments
        free = free_bytes(self.paths.checkpoints)
        if free is not None and free < needed:
            raise OutputError(
                f"{self.paths.checkpoints}: {human_bytes(free)} free, but one checkpoint "
                f"of this model takes about {human_bytes(needed)} (train.keep_checkpoints: "
                f"{self.p.train.keep_checkpoints} are kept); free some space or point "
                "--checkpoints elsewhere")

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

    def run_identity(self) -> dict:
        """Every setting that shapes the computation of the steps already taken.

        A checkpoint resumes only if all of these are unchanged. Which settings they are is
        declared once, in aiayn.config.PARAM_EFFECTS: the model, the seed and the training
        settings that shape the steps, not the run's length, logging, checkpointing, device,
        compilation, process count (a resumed run may move to more GPUs; see _resume) or
        validation, nor averaging and decoding. Beside them: the vocabulary, the tokenizer
        and the shards, by their hashes.
        """
        identity = {"seed": self.p.seed, "vocab_size": self.fingerprint["vocab_size"],
                    "tokenizer_sha256": self.fingerprint["tokenizer_sha256"]}
        identity.update({f"model.{k}": v for k, v in self.cfg.to_dict().items()})
        identity.update({f"train.{k}": v for k, v in self.p.train.model_dump(mode="json").items()
                         if shapes_training(f"train.{k}")})
        digest = hashlib.sha256()
        for split in ("train", "valid"):
            for name in ("meta.json", "batches.npy", "rows.npy"):
                digest.update(file_sha256(self.paths.shards / split / name).encode())
        identity["shards_sha256"] = digest.hexdigest()
        return identity

    def _move_now(self, items: list[Path], label: str = "") -> Path:
        """Move ``items`` to a new folder ``checkpoints.replaced/<time>[-label]/`` (rank 0
        alone): a run's files are never deleted."""
        folder = self.paths.checkpoints
        base = folder.with_name(folder.name + ".replaced") / (
            time.strftime("%Y%m%d-%H%M%S") + (f"-{label}" if label else ""))
        dest, n = base, 1
        while dest.exists():  # two moves in one second never mix their files
            n += 1
            dest = base.with_name(f"{base.name}-{n}")
        dest.mkdir(parents=True)
        for item in items:
            shutil.move(str(item), str(dest / item.name))
        runs = [d for d in base.parent.iterdir() if d.is_dir()]
        size = sum(f.stat().st_size for d in runs for f in d.rglob("*") if f.is_file())
        log.info("train: %s holds %d set-aside folder(s), %s in all; nothing there is ever "
                 "deleted by the pipeline: remove the folders you no longer need",
                 base.parent, len(runs), human_bytes(size))
        return dest

    def _move_aside(self, items: list[Path]) -> Path:
        """Move ``items`` of the checkpoint folder to ``checkpoints.replaced/<time>/``. Every
        rank has read them before, and waits after."""
        if self.world.distributed:
            torch.distributed.barrier()
        dest = self._move_now(items) if self.world.is_main else Path()
        if self.world.distributed:
            torch.distributed.barrier()
        return dest

    def _set_aside(self, why: str) -> None:
        """Move a run that cannot go on out of the way; a new run starts."""
        folder = self.paths.checkpoints
        dest = self._move_aside(sorted(folder.iterdir()))
        if self.world.is_main:
            log.warning("train: the run in %s %s; it does not resume. Its files were moved to "
                        "%s (delete them when no longer needed) and a new run starts.",
                        folder, why, dest)

    def _identity_changes(self, ckpt: dict) -> list[str]:
        """How the settings that shaped ``ckpt`` differ from this run's; none: it resumes.

        Only this run's identity is compared: a setting the checkpoint recorded that no
        longer shapes training (as declared now) changes nothing. A training setting added
        since the run started, at its default, computes as the code the run started with
        did: the run goes on."""
        saved = ckpt["meta"].get("identity") or {}
        absent = "(absent)"
        return [f"{k}: {saved.get(k, absent)!r} -> {v!r}" for k, v in sorted(self.identity.items())
                if saved.get(k, absent) != v and not (k not in saved and v == identity_default(k))]

    def _resume(self) -> None:
        self._recover_progress()
        self._resume_from_folder()
        self._mirror()

    def _mirror(self) -> None:
        """Keep checkpoints.progress in step with the checkpoint folder (rank 0)."""
        if not (self.world.is_main and self._mirroring):
            return
        try:
            mirror_checkpoints(self.paths.checkpoints)
        except OSError as exc:
            self._mirroring = False
            log.warning("train: cannot keep hard links to the checkpoints in %s (%s); a "
                        "`dvc exp run` that stops before DVC commits them will start over "
                        "from the committed ones", progress_folder(self.paths.checkpoints),
                        exc)

    def _newest(self, folder: Path) -> tuple[Path, dict] | None:
        try:
            return latest_checkpoint(folder, map_location="cpu")
        except DataError:
            return None

    def _recover_progress(self) -> None:
        """Put back the checkpoints that ``dvc exp run`` replaced by committed ones.

        Before it runs a stage, ``dvc exp run`` checks out every cached output as last
        committed, so a training it ran that stopped before DVC committed its checkpoints
        finds another run's checkpoints in their place (aiayn.checkpoint.progress_folder).
        They come back if they are this run's (same settings) and further along than what
        the folder holds; otherwise they are moved to checkpoints.replaced, never deleted.
        """
        if self.world.distributed:
            torch.distributed.barrier()
        if self.world.is_main:
            try:
                lost = unsaved_checkpoints(self.paths.checkpoints)
            except OSError:
                lost = []
            if lost:
                self._restore_or_keep(lost)
        if self.world.distributed:
            torch.distributed.barrier()

    def _restore_or_keep(self, lost: list[Path]) -> None:
        folder, mirror = self.paths.checkpoints, progress_folder(self.paths.checkpoints)
        held = list_checkpoints(folder)
        mine, theirs = self._newest(mirror), self._newest(folder)
        last = checkpoint_step(lost[-1])
        why = None
        if not held:
            why = (f"{folder} holds no checkpoints (deleted to start afresh?), so they are "
                   "not put back")
        elif mine is None:
            why = "none of them can be read"
        elif changes := self._identity_changes(mine[1]):
            why = f"they were made with other settings ({'; '.join(changes)})"
        elif (theirs is not None and not self._identity_changes(theirs[1])
              and checkpoint_step(theirs[0]) >= checkpoint_step(mine[0])):
            why = f"the folder's own run is as far along (step {checkpoint_step(theirs[0])})"
        if why is not None:
            dest = self._move_now(lost, label="progress")
            log.warning("train: %d checkpoint(s) up to step %d that %s no longer holds: %s. "
                        "They were moved to %s (delete them when no longer needed).",
                        len(lost), last, folder, why, dest)
            return
        dest = self._move_now(sorted(folder.iterdir()), label="checked-out")
        for link in list_checkpoints(mirror):
            os.link(link, folder / link.name)
        log.warning("train: %s held other checkpoints (up to step %d) than this run's, which "
                    "reached step %d: `dvc exp run` checks the last committed outputs out "
                    "before it runs a stage. This run's were put back from %s and it "
                    "resumes; what the folder held was moved to %s (delete it when no "
                    "longer needed).", folder, checkpoint_step(held[-1]),
                    checkpoint_step(mine[0]), mirror, dest)

    def _resume_from_folder(self) -> None:
        found = latest_checkpoint(self.paths.checkpoints, map_location=self.device)
        self._check_same_checkpoint(None if found is None else found[0])
        if found is None:
            return
        path, ckpt = found
        if changes := self._identity_changes(ckpt):
            self._set_aside(f"was made with other settings ({'; '.join(changes)})")
            return
        found = self._branch_point(path, ckpt)
        if found is None:
            return
        path, ckpt = found
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
        width = len(VALID_LOG_COLUMNS)  # rows of runs from before a column was added
        self.state = RunState(step=run["step"], tokens_seen=run["tokens_seen"],
                              elapsed_s=run["elapsed_s"], train_rows=run["train_rows"],
                              valid_rows=[r + [None] * (width - len(r))
                                          for r in run["valid_rows"]],
                              mlflow_run_id=ckpt["meta"].get("mlflow_run_id"),
                              bleu_seconds=run.get("bleu_seconds", 0.0),
                              stable_step=run.get("stable_step"))
        rngs = ckpt["rng"]
        set_rng_state(rngs[self.world.rank] if self.world.rank < len(rngs) else rngs[0])
        log.info("resumed from %s (step %d, %d target tokens seen)", path, self.state.step,
                 self.state.tokens_seen)

    def _schedule_moved(self, ckpt: dict) -> bool:
        """Whether a checkpoint took rates that this run's end would not give: the lr
        multiplier it recorded for its next step is not the one train.steps and
        train.max_minutes give now at its step and time. (Checkpoints written before the
        multiplier was recorded: no.)"""
        recorded = (ckpt["meta"].get("schedule") or {}).get("lr_factor")
        if recorded is None:
            return False
        run = ckpt["run"]
        return abs(lr_multiplier(self.p.train, run["step"], run["elapsed_s"]) - recorded) > 1e-9

    def _branch_point(self, path: Path, ckpt: dict) -> tuple[Path, dict] | None:
        """The checkpoint a run goes on from when its end moved after its cooldown began.

        Its checkpoints since the cooldown began took rates for the old end, so they are not
        part of the run the new end makes. Up to the cooldown the rate did not depend on the
        end: the newest checkpoint taken at the full rate under both ends (the trainer keeps
        one for this) is where the longer run from scratch would have been, and the run goes
        on from it, in a new MLflow run that repeats its history. The later checkpoints (and
        the old MLflow run's id) are moved aside. None: no such checkpoint, the run is set
        aside and a new one starts.
        """
        if not self._schedule_moved(ckpt):
            return path, ckpt
        folder, step = self.paths.checkpoints, checkpoint_step(path)
        old = ckpt["meta"].get("schedule") or {}
        ends = (f"train.steps {old.get('steps')} -> {self.p.train.steps}, train.max_minutes "
                f"{old.get('max_minutes')} -> {self.p.train.max_minutes}")
        stable = ckpt["run"].get("stable_step")
        for earlier in reversed(list_checkpoints(folder)):
            at = checkpoint_step(earlier)
            if at >= step or (stable is not None and at > stable):
                continue
            try:
                found = load_checkpoint(earlier, self.device)
            except DataError as exc:
                log.warning("skipping checkpoint: %s", exc)
                continue
            factor = (found["meta"].get("schedule") or {}).get("lr_factor")
            if factor != 1.0 or self._schedule_moved(found):
                continue
            later = [q for q in list_checkpoints(folder) if checkpoint_step(q) > at]
            run_file = [q for q in (folder / "mlflow_run.json",) if q.exists()]
            dest = self._move_aside(later + run_file)
            if self.world.is_main:
                log.warning(
                    "train: the end of the run in %s moved (%s) after its cooldown began, "
                    "so its checkpoints since took rates for the old end. It goes on from "
                    "step %d, its last checkpoint before the cooldown, where the longer run "
                    "from scratch would be; the %d later checkpoint(s) were moved to %s "
                    "(delete them when no longer needed), and a new MLflow run continues "
                    "it.", folder, ends, at, len(later), dest)
            self.branched_from = {"mlflow_run_id": found["meta"].get("mlflow_run_id"),
                                  "step": at}
            found["meta"]["mlflow_run_id"] = None
            return earlier, found
        self._set_aside(f"took its cooldown's rates for another end of training ({ends}) and "
                        "keeps no checkpoint from before its cooldown")
        return None

    def _check_same_checkpoint(self, path: Path | None) -> None:
        """Every process must resume from the same step: on several machines the checkpoint
        folder has to be one shared folder, or each would continue a different run."""
        if not self.world.distributed:
            return
        mine = -1 if path is None else checkpoint_step(path)
        steps: list = [None] * self.world.size
        torch.distributed.all_gather_object(steps, mine)
        if len(set(steps)) > 1:
            seen = ", ".join(f"rank {r}: {'none' if s < 0 else f'step {s}'}"
                             for r, s in enumerate(steps))
            raise DataError(
                f"{self.paths.checkpoints}: the processes find different latest checkpoints "
                f"({seen}); every machine must see the same checkpoint folder (shared "
                "storage such as NFS), or copy the newest checkpoint to each before resuming")

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
            none = torch.zeros(0, dtype=torch.long)
            batch = Batch(one, one, one, torch.zeros(1, dtype=torch.long), 0, 0,
                          tgt_positions=none)
        return self._loss(self.net, batch.to(self.device, non_blocking=True))

    def _loss(self, net: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, int]:
        return batch_loss(net, self.model.embedding.weight, batch, self.p.train.label_smoothing,
                          self.cfg.pad_id, self.fast, self.amp_dtype, self.output_vocab)

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
                        (loss * scale).backward()
                self._pending[1] += loss.detach()
                self._pending[2] += nll.detach()
        self._pending[0] += local_tokens
        params = [q for q in self.model.parameters() if q.grad is not None]
        if self.p.train.clip_norm > 0:
            self._grad_norm = torch.nn.utils.clip_grad_norm_(params, self.p.train.clip_norm)
        elif self._logs_at(self.state.step + 1):  # the norm is only shown, not used
            self._grad_norm = torch.nn.utils.get_total_norm([q.grad for q in params])
        self._lr = self.scheduler.get_last_lr()[0] * self.cooldown_factor()
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr
        self.optimizer.step()
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

        A non-finite loss stops the run here, before anything is logged or checkpointed,
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
        self._flush()  # collective; refuses to write after a non-finite loss
        rngs = self._gather_rng()  # collective: every rank calls it
        s = self.state
        factor = self.cooldown_factor()  # the next step's, under the end that made this one
        if factor == 1.0:
            s.stable_step = s.step
        if not self.world.is_main:
            return None
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "data": self.loader.state_dict(),
            "rng": rngs,
            "run": {"step": s.step, "tokens_seen": s.tokens_seen, "elapsed_s": s.elapsed_s,
                    "train_rows": s.train_rows, "valid_rows": s.valid_rows,
                    "bleu_seconds": s.bleu_seconds, "stable_step": s.stable_step},
            "meta": {**self.fingerprint, "identity": self.identity,
                     "mlflow_run_id": s.mlflow_run_id, "step": s.step,
                     "tokens_seen": s.tokens_seen, "world_size": self.world.size,
                     "valid_bleu": self._bleu_at(s.step),
                     "schedule": {"steps": self.p.train.steps,
                                  "max_minutes": self.p.train.max_minutes, "lr_factor": factor}},
        }
        # With a cooldown, the last checkpoint before it stays: a run whose end moves later
        # goes on from there (_branch_point).
        protect = self._best_steps()
        if self.p.train.cooldown > 0 and s.stable_step is not None:
            protect |= {s.stable_step}
        try:
            path = save_checkpoint(self.paths.checkpoints, s.step, state,
                                   keep=self.p.train.keep_checkpoints, protect=protect)
        except OutputError as exc:
            found = list_checkpoints(self.paths.checkpoints)
            resume = f"step {checkpoint_step(found[-1])}" if found else "the start"
            raise OutputError(f"training stopped at step {s.step}: {exc}; training then "
                              f"resumes from {resume}") from None
        self._mirror()
        return path

    def _bleu_at(self, step: int) -> float | None:
        """The validation BLEU of ``step``, if it was measured."""
        for row in reversed(self.state.valid_rows):
            if row[0] == step:
                return row[5]
        return None

    def _best_steps(self) -> set[int]:
        """With ``train.average: best``, the steps of the best-BLEU checkpoints, which the
        rotation of old checkpoints must not delete."""
        t = self.p.train
        if t.average != "best":
            return set()
        scored = [(r[5], r[0]) for r in self.state.valid_rows if r[5] is not None]
        return {step for _, step in sorted(scored, reverse=True)[:t.average_last]}

    def write_logs(self) -> None:
        if not self.world.is_main:
            return
        # The BLEU rows alone too: a plot of valid_log.tsv would draw its empty BLEU cells
        # (validation steps without BLEU) as zeros.
        bleu_rows = [[r[0], r[5]] for r in self.state.valid_rows if r[5] is not None]
        for path, columns, rows in ((self.paths.train_log, TRAIN_LOG_COLUMNS,
                                     self.state.train_rows),
                                    (self.paths.valid_log, VALID_LOG_COLUMNS,
                                     self.state.valid_rows),
                                    (self.paths.valid_bleu_log, ("step", "valid_bleu"),
                                     bleu_rows)):
            lines = ["\t".join(columns)] + ["\t".join(_fmt(v) for v in row) for row in rows]
            with atomic_path(path) as tmp:
                tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")

    def _track(self, metrics: dict, step: int) -> None:
        if self.tracker is not None and self.world.is_main:
            self.tracker.log_metrics(metrics, step=step)

    def replay_history(self) -> None:
        """Log the curves of the steps already taken (a new MLflow run of a resumed run)."""
        for row in self.state.train_rows:
            self._track(train_metrics(row), int(row[0]))
        for row in self.state.valid_rows:
            self._track(valid_metrics(row), int(row[0]))

    # -- the run --------------------------------------------------------------------------

    def fit(self, should_stop: Callable[[], bool] = lambda: False) -> dict:
        p, s = self.p.train, self.state
        budget_s = 60 * p.max_minutes if p.max_minutes else math.inf
        if self.world.is_main:
            log.info("train: %s parameters, %d process(es) on %s, %s, %s kernels%s, "
                     "accumulation %d (<= %d tokens per batch, %d per step)%s",
                     f"{count_parameters(self.model):,}", self.world.size, self.device,
                     "bf16 autocast" if self.amp_dtype else "fp32", p.kernels,
                     (", compiled" if p.compile else "")
                     + (f", subword split {p.subword_split:g}" if p.subword_split else ""),
                     self.accum,
                     int(self.train_data.meta["max_tokens"]), p.tokens_per_step,
                     f", time budget {p.max_minutes:g} min" if p.max_minutes else "")
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
        session_start = time.perf_counter()
        elapsed_at_start = s.elapsed_s
        last_ckpt_time, window_start = time.monotonic(), time.perf_counter()
        window = [0.0, 0.0, 0.0]  # target tokens, loss sum, NLL sum since the last log row
        self.model.train()
        try:
            while s.step < p.steps:
                self.train_step(self._micro_batches(it))
                self.heap.after_step(s.step)
                elapsed = elapsed_at_start + time.perf_counter() - session_start
                # Rank 0 decides (its clock), every rank follows: one collective per step.
                # Its elapsed time also sets the cooldown's lr, the same on every rank.
                due_time = (p.checkpoint_every_minutes
                            and time.monotonic() - last_ckpt_time
                            >= 60 * p.checkpoint_every_minutes)
                due_steps = p.checkpoint_every_steps and s.step % p.checkpoint_every_steps == 0
                due, stop, s.elapsed_s = distributed.broadcast_values(
                    [bool(due_steps or due_time), should_stop(), elapsed],
                    self.device, self.world)
                due, stop, out_of_time = bool(due), bool(stop), s.elapsed_s >= budget_s
                finished = s.step == p.steps or out_of_time
                if self._logs_at(s.step) or out_of_time:
                    window = [a + b for a, b in zip(window, self._flush(), strict=True)]
                    now = time.perf_counter()
                    self._log_row(window, now - window_start, bar)
                    window, window_start = [0.0, 0.0, 0.0], now
                bleu = bool(p.valid_bleu_every) and (s.step % p.valid_bleu_every == 0 or finished)
                if s.step % p.valid_every == 0 or finished or bleu:
                    self._validate_row(bleu)
                if bar is not None:
                    bar.update(1)
                if due or finished:
                    self.write_logs()
                    self.checkpoint()
                    last_ckpt_time = time.monotonic()
                if out_of_time:
                    s.stopped_by = "time budget"
                    if self.world.is_main:
                        log.info("train: time budget of %g min spent at step %d (%.1f min over "
                                 "all sessions); checkpoint written", p.max_minutes, s.step,
                                 s.elapsed_s / 60)
                    break
                if stop:
                    if not finished:  # interrupted: keep every finished step
                        self.write_logs()
                        self.checkpoint()
                        s.stopped_by = "interrupted"
                        if self.world.is_main:
                            log.info("stopped at step %d; checkpoint written, run the same "
                                     "command again to resume", s.step)
                    break
            if s.step >= p.steps:
                s.stopped_by = "steps"
        except torch.OutOfMemoryError as exc:
            raise OutOfMemory(
                f"out of memory at step {s.step + 1} with batches of up to "
                f"{self.train_data.meta['max_tokens']} tokens ({exc}); lower shard.max_tokens "
                "and re-run the shard stage (train.tokens_per_step stays, accumulation grows); "
                "training resumes from the last checkpoint") from None
        finally:
            if bar is not None:
                bar.close()
            self.loader.close()
        return self.summary()

    def _log_row(self, window: list[float], seconds: float, bar) -> None:
        s = self.state
        tokens, loss, nll = window
        tps = tokens / max(seconds, 1e-9)
        grad_norm = float(self._grad_norm) if self._grad_norm is not None else float("nan")
        row = [s.step, loss / max(tokens, 1), nll / max(tokens, 1), self._lr, grad_norm,
               s.tokens_seen, tps, s.elapsed_s]
        s.train_rows.append(row)
        self._track(train_metrics(row), s.step)
        if bar is not None:
            bar.set_postfix(loss=f"{row[1]:.3f}", lr=f"{row[3]:.2e}", tok_s=f"{tps:,.0f}",
                            refresh=False)

    def _validate_row(self, bleu: bool = False) -> None:
        s = self.state
        v = self.validate()
        score = self._valid_bleu() if bleu else None
        s.valid_rows.append([s.step, v["valid_loss"], v["valid_nll"], v["valid_ppl"],
                             v["tokens"], score])
        self._track(valid_metrics(s.valid_rows[-1]), s.step)
        if self.world.is_main:
            log.info("step %d: valid loss %.4f, nll %.4f, ppl %.2f%s", s.step, v["valid_loss"],
                     v["valid_nll"], v["valid_ppl"],
                     "" if score is None else f", sacreBLEU {score:.2f}")

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
            **hardware(self.device),
            "kernels": self.p.train.kernels,
            "output_vocab": self.cfg.output_vocab,
            "output_vocab_size": (self.cfg.vocab_size if self.output_vocab is None
                                  else int(self.output_vocab.ids.numel())),
            "compile": self.p.train.compile,
            "subword_split": self.p.train.subword_split,
            "max_minutes": self.p.train.max_minutes,
            "stopped_by": s.stopped_by,
            **self._bleu_summary(),
        }

    def _bleu_summary(self) -> dict:
        s = self.state
        scored = [(r[5], r[0]) for r in s.valid_rows if r[5] is not None]
        if not scored:
            return {}
        best, best_step = max(scored, key=lambda x: (x[0], -x[1]))  # earliest of equals
        return {"valid_bleu": scored[-1][0], "best_valid_bleu": best,
                "best_valid_bleu_step": best_step,
                "valid_bleu_seconds": round(s.bleu_seconds, 3),
                "valid_bleu_share": s.bleu_seconds / s.elapsed_s if s.elapsed_s else 0.0}

    def write_summary(self, summary: dict) -> None:
        if self.world.is_main:
            write_json(self.paths.metrics, summary)


def train_metrics(row: list) -> dict:
    """The MLflow metrics of a train_log row (TRAIN_LOG_COLUMNS)."""
    return {"train/loss": row[1], "train/nll": row[2], "train/lr": row[3],
            "train/grad_norm": row[4], "train/tokens_per_s": row[6]}


def valid_metrics(row: list) -> dict:
    """The MLflow metrics of a valid_log row (VALID_LOG_COLUMNS); BLEU where measured."""
    out = {"valid/loss": row[1], "valid/nll": row[2], "valid/ppl": row[3]}
    if row[5] is not None:
        out["valid/sacrebleu"] = row[5]
    return out


def identity_default(key: str):
    """The default of a run-identity entry ``train.<name>`` or ``model.<name>`` (what a run
    started before the setting existed used); a marker equal to nothing for every other
    entry."""
    section, _, name = key.partition(".")
    if section == "train":
        defaults = TrainConfig().model_dump(mode="json")
    elif section == "model":
        defaults = {f.name: f.default for f in dataclasses.fields(TransformerConfig)
                    if f.default is not dataclasses.MISSING}
    else:
        defaults = {}
    return defaults.get(name, object())


def _fmt(v) -> str:
    if v is None:  # not measured at this step (e.g. BLEU between its passes)
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)
