"""The checkpoint folder of a training run, and its whole policy.

The training loop asks the store for the checkpoint to resume from and hands it the state to
save; everything else about the folder is decided here:

* **identity**: a checkpoint resumes only if every setting that shaped its steps is unchanged
  (:func:`run_identity`, derived from ``aiayn.config.PARAM_EFFECTS``); otherwise the run is
  **set aside** into ``<folder>.replaced/<time>/`` (never deleted) and a new one starts;
* **recovery**: ``dvc exp run`` checks the last committed outputs out before it runs a
  stage, so a run it interrupted finds another run's checkpoints in its folder; its own
  come back from the hard links in ``<folder>.progress`` (``aiayn.training.checkpoint``);
* **branch point**: with ``train.cooldown`` (or ``train.rdrop_start``), a run whose end
  (``train.steps``, ``train.max_minutes``) moved after its cooldown (or R-Drop) began goes
  on from its last checkpoint taken at the full rate and without R-Drop, where the longer
  run from scratch would be (the warmup-stable-decay branching of Hagele et al. 2024); the
  store keeps that checkpoint for it. A run whose ``train.steps`` was lowered below its
  checkpoints goes back to its last checkpoint within the new end in the same way;
* **rotation**: the newest ``train.keep_checkpoints`` stay, plus the ones the loop protects;
  a checkpoint written only to stop a run (Ctrl-C, SIGTERM) goes when the next is written.

Only rank 0 moves files; every rank reads the same folder and waits at the same barriers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from aiayn.config import Params, TrainConfig, shapes_training
from aiayn.errors import DataError, OutputError
from aiayn.io import file_sha256, free_bytes, human_bytes
from aiayn.model import TransformerConfig
from aiayn.training.checkpoint import (
    checkpoint_step,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    mirror_checkpoints,
    progress_folder,
    save_checkpoint,
    unsaved_checkpoints,
)
from aiayn.training.distributed import World
from aiayn.training.schedule import end_independent

log = logging.getLogger("aiayn")



def run_identity(p: Params, cfg: TransformerConfig, tokenizer_sha256: str,
                 shards: Path) -> dict:
    """Every setting that shapes the computation of a run's steps.

    Which settings they are is declared once, in aiayn.config.PARAM_EFFECTS: the model, the
    seed and the training settings that shape the steps; not the run's length, logging,
    checkpointing, device, compilation, process count (a resumed run may move to more GPUs)
    or validation, nor averaging and decoding. Beside them: the vocabulary, the tokenizer and
    the shards, by their hashes.
    """
    identity = {"seed": p.seed, "vocab_size": cfg.vocab_size,
                "tokenizer_sha256": tokenizer_sha256}
    identity.update({f"model.{k}": v for k, v in cfg.to_dict().items()})
    identity.update({f"train.{k}": v for k, v in p.train.model_dump(mode="json").items()
                     if shapes_training(f"train.{k}")})
    digest = hashlib.sha256()
    for split in ("train", "valid"):
        for name in ("meta.json", "batches.npy", "rows.npy"):
            digest.update(file_sha256(shards / split / name).encode())
    identity["shards_sha256"] = digest.hexdigest()
    return identity


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


def identity_changes(saved: dict, now: dict) -> list[str]:
    """How the identity ``saved`` with a checkpoint differs from ``now``; none: it resumes.

    Only the current identity is compared: a setting the checkpoint recorded that no longer
    shapes training (as declared now) changes nothing. A training setting added since the
    run started, at its default, computes as the code the run started with did: the run
    goes on."""
    absent = "(absent)"
    return [f"{k}: {saved.get(k, absent)!r} -> {v!r}" for k, v in sorted(now.items())
            if saved.get(k, absent) != v and not (k not in saved and v == identity_default(k))]


class RunStore:
    """One run's checkpoint folder (see the module's docstring).

    ``schedule(step, elapsed_s)`` is what this run's end decides for a step: the cooldown's
    lr multiplier and whether train.rdrop_start has switched R-Drop on
    (aiayn.training.schedule.schedule_at); ``end`` describes that end for messages.
    ``run_files``: names of files beside the checkpoints that belong to the run (a
    tracker's record of it): a branch moves them aside with the checkpoints after the
    branch point, as setting a run aside moves the whole folder.
    """

    def __init__(self, folder: Path, world: World, device: torch.device, identity: dict,
                 schedule: Callable[[int, float], dict], end: dict,
                 run_files: tuple[str, ...] = ()):
        self.folder, self.world, self.device = Path(folder), world, device
        self.identity, self.schedule, self.end = identity, schedule, end
        self.run_files = tuple(run_files)
        # After a branch: {"step": the branch point, "aside": where the run's later
        # checkpoints and its run files went}; else None.
        self.branched_from: dict | None = None
        self._mirroring = True  # hard links in <folder>.progress (mirror)

    # -- before training -------------------------------------------------------------------

    def check_room(self, needed: int, keep: int) -> None:
        """Fail before training, not at its first checkpoint, where one cannot fit."""
        free = free_bytes(self.folder)
        if free is not None and free < needed:
            raise OutputError(
                f"{self.folder}: {human_bytes(free)} free, but one checkpoint of this model "
                f"takes about {human_bytes(needed)} (train.keep_checkpoints: {keep} are "
                "kept); free some space or point --checkpoints elsewhere")

    def resume_point(self) -> tuple[Path, dict] | None:
        """The checkpoint this run goes on from (loaded onto the device), or None: a new run.

        Puts back what ``dvc exp run`` checked out over, sets aside a run made with other
        settings, and goes back to the branch point of a run whose end moved."""
        self._recover_progress()
        found = latest_checkpoint(self.folder, map_location=self.device)
        self._check_same_checkpoint(None if found is None else found[0])
        if found is not None:
            path, ckpt = found
            if changes := identity_changes(ckpt["meta"].get("identity") or {}, self.identity):
                self._set_aside(f"was made with other settings ({'; '.join(changes)})")
                found = None
            else:
                found = self._branch_point(path, ckpt)
        self.mirror()
        return found

    # -- while training --------------------------------------------------------------------

    def save(self, step: int, state: dict, keep: int, protect: set[int],
             replaced: set[int] = frozenset()) -> Path:
        """Write the checkpoint of ``step`` (rank 0), delete those of ``replaced``, rotate
        the old ones except ``protect``, and mirror the folder."""
        try:
            path = save_checkpoint(self.folder, step, state, keep=keep, protect=protect,
                                   replaced=replaced)
        except OutputError as exc:
            found = list_checkpoints(self.folder)
            resume = f"step {checkpoint_step(found[-1])}" if found else "the start"
            raise OutputError(f"training stopped at step {step}: {exc}; training then "
                              f"resumes from {resume}") from None
        self.mirror()
        return path

    def mirror(self) -> None:
        """Keep <folder>.progress in step with the checkpoint folder (rank 0)."""
        if not (self.world.is_main and self._mirroring):
            return
        try:
            mirror_checkpoints(self.folder)
        except OSError as exc:
            self._mirroring = False
            log.warning("train: cannot keep hard links to the checkpoints in %s (%s); a "
                        "`dvc exp run` that stops before DVC commits them will start over "
                        "from the committed ones", progress_folder(self.folder), exc)

    # -- setting aside ---------------------------------------------------------------------

    def _move_now(self, items: list[Path], label: str = "") -> Path:
        """Move ``items`` to a new folder ``<folder>.replaced/<time>[-label]/`` (rank 0
        alone): a run's files are never deleted."""
        base = self.folder.with_name(self.folder.name + ".replaced") / (
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
        """Move ``items`` of the folder aside (rank 0). Every rank has read them before, and
        waits after."""
        self._barrier()
        dest = self._move_now(items) if self.world.is_main else Path()
        self._barrier()
        return dest

    def _set_aside(self, why: str) -> None:
        """Move a run that cannot go on out of the way; a new run starts."""
        dest = self._move_aside(sorted(self.folder.iterdir()))
        if self.world.is_main:
            log.warning("train: the run in %s %s; it does not resume. Its files were moved to "
                        "%s (delete them when no longer needed) and a new run starts.",
                        self.folder, why, dest)

    def _barrier(self) -> None:
        if self.world.distributed:
            torch.distributed.barrier()

    # -- recovery after `dvc exp run` ------------------------------------------------------

    def _newest(self, folder: Path) -> tuple[Path, dict] | None:
        try:
            return latest_checkpoint(folder, map_location="cpu")
        except DataError:
            return None

    def _recover_progress(self) -> None:
        """Put back the checkpoints that ``dvc exp run`` replaced by committed ones.

        Before it runs a stage, ``dvc exp run`` checks out every cached output as last
        committed, so a training it ran that stopped before DVC committed its checkpoints
        finds another run's checkpoints in their place (aiayn.training.checkpoint.progress_folder).
        They come back if they are this run's (same settings) and further along than what
        the folder holds; otherwise they are moved to <folder>.replaced, never deleted.
        """
        self._barrier()
        if self.world.is_main:
            try:
                lost = unsaved_checkpoints(self.folder)
            except OSError:
                lost = []
            if lost:
                self._restore_or_keep(lost)
        self._barrier()

    def _restore_or_keep(self, lost: list[Path]) -> None:
        folder, mirror = self.folder, progress_folder(self.folder)
        held = list_checkpoints(folder)
        mine, theirs = self._newest(mirror), self._newest(folder)
        last = checkpoint_step(lost[-1])

        def changes(ckpt: dict) -> list[str]:
            return identity_changes(ckpt["meta"].get("identity") or {}, self.identity)

        why = None
        if not held:
            why = (f"{folder} holds no checkpoints (deleted to start afresh?), so they are "
                   "not put back")
        elif mine is None:
            why = "none of them can be read"
        elif differ := changes(mine[1]):
            why = f"they were made with other settings ({'; '.join(differ)})"
        elif (theirs is not None and not changes(theirs[1])
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

    # -- the branch point of a moved end -----------------------------------------------------

    def _schedule_moved(self, ckpt: dict) -> bool:
        """Whether a checkpoint took a schedule that this run's end would not give: the lr
        multiplier (or the R-Drop switch) it recorded for its next step is not the one this
        run's end gives now at its step and time. (What a checkpoint did not record: no.)"""
        recorded = ckpt["meta"].get("schedule") or {}
        run = ckpt["run"]
        now = self.schedule(run["step"], run["elapsed_s"])
        if "lr_factor" in recorded and abs(now["lr_factor"] - recorded["lr_factor"]) > 1e-9:
            return True
        return "rdrop_started" in recorded and now["rdrop_started"] != recorded["rdrop_started"]

    def _branch_point(self, path: Path, ckpt: dict) -> tuple[Path, dict] | None:
        """The checkpoint a run goes on from when its end moved after its cooldown (or
        train.rdrop_start's R-Drop) began.

        Its checkpoints since took rates (or R-Drop) for the old end, so they are not part of
        the run the new end makes. Up to then the steps did not depend on the end: the newest
        checkpoint taken at the full rate and before the R-Drop switch under both ends (the
        loop protects one for this) is where the longer run from scratch would have been, and
        the run goes on from it, as a new run that repeats its history. The later
        checkpoints (and the run's files, ``run_files``) are moved aside. None: no such
        checkpoint, the run is set aside and a new one starts.
        """
        step = checkpoint_step(path)
        last = self.end.get("steps")
        beyond = last is not None and step > last  # train.steps lowered below the run
        if not (beyond or self._schedule_moved(ckpt)):
            return path, ckpt
        old = ckpt["meta"].get("schedule") or {}
        ends = (f"train.steps {old.get('steps')} -> {self.end.get('steps')}, "
                f"train.max_minutes {old.get('max_minutes')} -> {self.end.get('max_minutes')}")
        stable = ckpt["run"].get("stable_step")
        for earlier in reversed(list_checkpoints(self.folder)):
            at = checkpoint_step(earlier)
            if at >= step or (stable is not None and at > stable) or (beyond and at > last):
                continue
            try:
                found = load_checkpoint(earlier, self.device)
            except DataError as exc:
                log.warning("skipping checkpoint: %s", exc)
                continue
            if (not end_independent(found["meta"].get("schedule") or {})
                    or self._schedule_moved(found)):
                continue
            later = [q for q in list_checkpoints(self.folder) if checkpoint_step(q) > at]
            run_files = [q for q in (self.folder / n for n in self.run_files) if q.exists()]
            dest = self._move_aside(later + run_files)
            if self.world.is_main and beyond:
                log.warning(
                    "train: the run in %s trained to step %d, beyond train.steps %d (%s). "
                    "It goes back to step %d, its last checkpoint within the new end, where "
                    "the shorter run from scratch would be; the %d later checkpoint(s) were "
                    "moved to %s (delete them when no longer needed), and it goes on as a new "
                    "run (a new MLflow run too).", self.folder, step, last, ends, at, len(later),
                    dest)
            elif self.world.is_main:
                log.warning(
                    "train: the end of the run in %s moved (%s) after its cooldown (or "
                    "train.rdrop_start's R-Drop) began, so its checkpoints since took rates "
                    "for the old end. It goes on from step %d, its last checkpoint before "
                    "then, where the longer run "
                    "from scratch would be; the %d later checkpoint(s) were moved to %s "
                    "(delete them when no longer needed), and it goes on as a new run (a new "
                    "MLflow run too).", self.folder, ends, at, len(later), dest)
            self.branched_from = {"step": at, "aside": dest}
            return earlier, found
        self._set_aside(f"trained beyond train.steps ({ends}) and keeps no checkpoint "
                        "within the new end" if beyond else
                        f"took its cooldown's rates for another end of training ({ends}) and "
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
                f"{self.folder}: the processes find different latest checkpoints ({seen}); "
                "every machine must see the same checkpoint folder (shared storage such as "
                "NFS), or copy the newest checkpoint to each before resuming")
