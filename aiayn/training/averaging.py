"""The model folder written from a run's checkpoints (Section 6.1: "a single model obtained
by averaging the last 5 checkpoints"), as `aiayn average` writes it.

:func:`average_into_folder` is the whole of it: the last (or best by validation BLEU) N
checkpoints of ``checkpoints_dir``, checked to come from one run (one model configuration,
vocabulary and tokenizer hash) and to have been trained with ``tokenizer``; their
element-wise mean (:func:`aiayn.training.checkpoint.average_checkpoints`), checked to load
into the model they record; and the folder (:func:`aiayn.training.checkpoint.export_model`):
model.safetensors, config.json and a copy of the tokenizer. :class:`RunCheckpoints` is the
same in two steps, for a caller that first tries several counts (the stage's
``train.average_candidates``): open once, then ``choose``, load into ``model``, ``write``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from aiayn.errors import DataError
from aiayn.io import file_sha256
from aiayn.model import Transformer, TransformerConfig
from aiayn.tracking import RUN_FILE, load_run_id
from aiayn.training.checkpoint import (
    average_checkpoints,
    checkpoint_step,
    export_model,
    list_checkpoints,
    load_checkpoint,
)

log = logging.getLogger("aiayn")

# What a checkpoint's `meta` must hold, and what the checkpoints averaged together share.
META_KEYS = ("model_config", "vocab_size", "tokenizer_sha256")
HOWS = ("last", "best")


@dataclass
class RunCheckpoints:
    """The checkpoints of one training run in ``folder``, checked (:meth:`open`) to share
    one model configuration and tokenizer hash, and to have been trained with ``tokenizer``.

    ``how``: ``last`` takes the newest checkpoints, ``best`` those with the best validation
    BLEU recorded at training time (``train.valid_bleu_every``); ``most``: how many were
    checked, the largest count :meth:`choose` takes. ``meta`` is the `meta` of the newest
    checkpoint checked, ``newest`` its path.
    """

    folder: Path
    tokenizer: Path
    how: str
    most: int
    found: list[Path]
    newest: Path
    meta: dict

    @classmethod
    def open(cls, folder: Path, tokenizer: Path, most: int = 5, how: str = "last"
             ) -> RunCheckpoints:
        """The run's checkpoints, of which the ``most`` that ``how`` chooses (every average
        that may follow is drawn from those) are checked."""
        folder, tokenizer = Path(folder), Path(tokenizer)
        if how not in HOWS:
            raise ValueError(f"how must be {' or '.join(map(repr, HOWS))}, not {how!r}")
        found = list_checkpoints(folder)
        if not found:
            raise DataError(f"no checkpoints in {folder}; run `aiayn train`")
        pool, metas = choose_checkpoints(found, most, how, folder)
        newest_path, newest = pool[-1], metas[pool[-1]]
        for path in pool:
            for key in META_KEYS:
                if metas[path][key] != newest[key]:
                    raise DataError(
                        f"{path} and {newest_path} differ in {key} ({metas[path][key]!r} vs "
                        f"{newest[key]!r}): they come from different training runs; delete "
                        f"the stale checkpoints from {folder} or re-run `aiayn train`")
        check_tokenizer(tokenizer, newest["tokenizer_sha256"],
                        f"the checkpoints in {folder} were trained with")
        return cls(folder, tokenizer, how, most, found, newest_path, newest)

    def choose(self, n: int) -> tuple[list[Path], dict[Path, dict]]:
        """The (at most) ``n`` checkpoints ``how`` takes, in step order, and their metas."""
        if n > self.most:
            raise ValueError(f"{n} checkpoints asked for, but only the {self.most} that "
                             f"{self.how!r} takes were checked; open with most={n}")
        return choose_checkpoints(self.found, n, self.how, self.folder)

    @functools.cached_property
    def model(self) -> Transformer:
        """A model of the recorded configuration (built once), on the CPU unless moved:
        :func:`load_weights` puts an average into it."""
        try:
            return Transformer(TransformerConfig(**self.meta["model_config"]))
        except (TypeError, ValueError) as exc:
            raise DataError(f"{self.newest}: its recorded model configuration is not valid "
                            f"({str(exc)[:300]}); re-run `aiayn train`") from None

    def write(self, out: Path, n: int, *,
              candidate_scores: Mapping[int, float] | None = None) -> dict:
        """Average the ``n`` checkpoints :meth:`choose` takes into the model folder ``out``
        (fewer, with a warning, if fewer exist); the config.json written.
        ``candidate_scores``: the validation BLEU of each count tried before choosing
        ``n``, recorded in config.json (then fewer checkpoints than ``n`` is no news)."""
        model = self.model  # the folder must load into the model it claims: built first
        chosen, metas = self.choose(n)
        if len(chosen) < n and not candidate_scores:
            log.warning("average: %d checkpoint(s) asked for but %s holds only %d "
                        "%scheckpoint(s); averaging those %d", n, self.folder, len(chosen),
                        "scored " if self.how == "best" else "", len(chosen))
        steps = [int(metas[path].get("step", checkpoint_step(path))) for path in chosen]
        bleu = [metas[path].get("valid_bleu") for path in chosen]
        log.info("average: averaging %d checkpoint(s) (%s), steps %s%s", len(chosen),
                 self.how, steps, f", validation sacreBLEU {[round(b, 2) for b in bleu]}"
                 if self.how == "best" else "")
        weights = average_checkpoints(chosen, key="model")
        load_weights(model, weights, self.newest)
        config = {
            "model": self.meta["model_config"],
            "vocab_size": self.meta["vocab_size"],
            "tokenizer_sha256": self.meta["tokenizer_sha256"],
            "mlflow_run_id": load_run_id(self.folder / RUN_FILE),
            "average": self.how,
            "averaged_steps": steps,
            "averaged_valid_bleu": bleu,
            "average_candidates_valid_bleu": {str(k): score for k, score in
                                              (candidate_scores or {}).items()},
            "tokens_seen": self.meta.get("tokens_seen"),
        }
        export_model(out, weights, config, extra_files={"tokenizer.json": self.tokenizer})
        return config


def average_into_folder(checkpoints_dir: Path, tokenizer: Path, out: Path, last: int = 5,
                        how: str = "last") -> dict:
    """Write the model folder ``out`` (model.safetensors, config.json, tokenizer.json) from
    the mean of the ``last`` checkpoints in ``checkpoints_dir`` that ``how`` chooses
    (``last``: the newest; ``best``: the best by validation BLEU), as `aiayn average` does
    without ``train.average_candidates``; the config.json written. ``tokenizer``: the
    tokenizer the run was trained with (its sha256 is checked), copied into ``out``."""
    return RunCheckpoints.open(checkpoints_dir, tokenizer, last, how).write(out, last)


def check_tokenizer(tokenizer: Path, sha256: str, trained: str) -> None:
    """A DataError unless ``tokenizer`` exists and its sha256 is ``sha256``, the one
    recorded in training: ``trained`` says whose (say, "data/checkpoints/step-00000100.pt
    was trained with")."""
    if not tokenizer.is_file():
        raise DataError(f"{tokenizer}: no tokenizer; run the vocab stage first (`aiayn vocab`)")
    sha = file_sha256(tokenizer)
    if sha != sha256:
        raise DataError(
            f"{tokenizer}: sha256 {sha[:12]}… differs from the {sha256[:12]}… {trained}: "
            "the vocabulary changed since training; re-run training (`aiayn train`)")


def load_weights(model: Transformer, weights: dict, path: Path) -> None:
    """``weights`` into ``model``, every one of them; a DataError naming ``path`` where they
    do not fit."""
    try:
        model.load_state_dict(weights, strict=True)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise DataError(f"{path}: the averaged weights do not fit the recorded model "
                        f"configuration ({str(exc)[:300]}); re-run `aiayn train`") from None


def choose_checkpoints(found: list[Path], n: int, how: str, folder: Path
                       ) -> tuple[list[Path], dict[Path, dict]]:
    """The checkpoints of ``found`` that ``how`` picks (at most ``n``, in step order) and
    their metas."""
    if how == "best":
        return _best(found, n, folder)
    chosen = found[-n:]
    return chosen, {path: checkpoint_meta(path) for path in chosen}


def _best(found: list[Path], n: int, folder: Path) -> tuple[list[Path], dict[Path, dict]]:
    """The ``n`` checkpoints with the best validation BLEU (of equals, the later), in step
    order, with their metas."""
    metas = {path: checkpoint_meta(path) for path in found}
    scored = [path for path in found if metas[path].get("valid_bleu") is not None]
    if not scored:
        raise DataError(
            f"train.average is 'best' but none of the {len(found)} checkpoints in {folder} "
            "has a validation BLEU; train with train.valid_bleu_every set (a multiple of "
            "train.checkpoint_every_steps), or set train.average: last")
    best = sorted(scored, key=lambda path: (metas[path]["valid_bleu"], checkpoint_step(path)),
                  reverse=True)[:n]
    chosen = sorted(best, key=checkpoint_step)
    return chosen, {path: metas[path] for path in chosen}


def checkpoint_meta(path: Path, state: dict | None = None) -> dict:
    """The `meta` dict of a checkpoint (of its loaded ``state``, else read without loading
    its tensors into memory), its model configuration with every field."""
    state = load_checkpoint(path, mmap=True) if state is None else state
    meta = state.get("meta")
    if not isinstance(meta, dict) or any(key not in meta for key in META_KEYS):
        raise DataError(f"{path}: no `meta` with {', '.join(META_KEYS)}; this checkpoint was "
                        "not written by `aiayn train`")
    # With every field, defaults included: a run resumed across a version that added a
    # model setting (model.output_vocab) holds checkpoints written without it and with it.
    try:
        meta["model_config"] = TransformerConfig(**meta["model_config"]).to_dict()
    except (TypeError, ValueError) as exc:
        raise DataError(f"{path}: its model_config does not describe a model this version "
                        f"builds ({exc}); average it with the version that trained it") from None
    return meta
