"""A training run's log: one typed row per logging step and per validation pass.

The rows live in the run's checkpoints (so a resumed run keeps its history), in
``metrics/{train,valid}_log.tsv`` and ``valid_bleu.tsv`` (git, ``dvc plots``) and, through
the training stage, in MLflow. Each row knows its columns, its TSV line and its MLflow
metrics; nothing else indexes into it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import astuple, dataclass, field
from pathlib import Path

from aiayn.io import atomic_path


@dataclass
class TrainRow:
    """The training loss since the previous row, per target token."""

    step: int
    loss: float  # label-smoothed
    nll: float
    lr: float
    grad_norm: float  # NaN where not computed
    tokens: int  # target tokens seen so far
    tokens_per_s: float  # training's, since the previous row (validation and checkpoints
    # are left out: their time is in elapsed_s)
    elapsed_s: float  # training time so far, over all sessions

    def metrics(self) -> dict[str, float]:
        return {"train/loss": self.loss, "train/nll": self.nll, "train/lr": self.lr,
                "train/grad_norm": self.grad_norm, "train/tokens_per_s": self.tokens_per_s}


@dataclass
class ValidRow:
    """A validation pass: loss over the valid shards, and sacreBLEU where it was measured."""

    step: int
    valid_loss: float
    valid_nll: float
    valid_ppl: float
    tokens: int  # valid target tokens
    valid_bleu: float | None = None  # None: not measured at this step

    def metrics(self) -> dict[str, float]:
        out = {"valid/loss": self.valid_loss, "valid/nll": self.valid_nll,
               "valid/ppl": self.valid_ppl}
        if self.valid_bleu is not None:
            out["valid/sacrebleu"] = self.valid_bleu
        return out


def columns(row_type: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(row_type))


def _from_saved(row_type: type, saved: list) -> object:
    """A row from its saved values (column order); a row saved before later columns existed
    gets their defaults."""
    names = columns(row_type)
    return row_type(**dict(zip(names, saved, strict=False)))


@dataclass
class RunLog:
    train: list[TrainRow] = field(default_factory=list)
    valid: list[ValidRow] = field(default_factory=list)

    # -- saving in checkpoints (plain lists: torch.load(weights_only=True) reads them) ----

    def to_saved(self) -> dict[str, list[list]]:
        return {"train_rows": [list(astuple(r)) for r in self.train],
                "valid_rows": [list(astuple(r)) for r in self.valid]}

    @classmethod
    def from_saved(cls, run: dict) -> RunLog:
        return cls([_from_saved(TrainRow, r) for r in run.get("train_rows", [])],
                   [_from_saved(ValidRow, r) for r in run.get("valid_rows", [])])

    # -- questions about the run -----------------------------------------------------------

    def scored(self) -> list[ValidRow]:
        """The validation passes that measured BLEU, in order."""
        return [r for r in self.valid if r.valid_bleu is not None]

    def bleu_at(self, step: int) -> float | None:
        for row in reversed(self.valid):
            if row.step == step:
                return row.valid_bleu
        return None

    def best_bleu_steps(self, count: int) -> set[int]:
        """The steps of the ``count`` best validation BLEUs (the later of equal scores)."""
        ranked = sorted(((r.valid_bleu, r.step) for r in self.scored()), reverse=True)
        return {step for _, step in ranked[:count]}

    def bleu_summary(self, bleu_seconds: float, elapsed_s: float) -> dict:
        scored = self.scored()
        if not scored:
            return {}
        best = max(scored, key=lambda r: (r.valid_bleu, -r.step))  # the earliest of equals
        return {"valid_bleu": scored[-1].valid_bleu, "best_valid_bleu": best.valid_bleu,
                "best_valid_bleu_step": best.step,
                "valid_bleu_seconds": round(bleu_seconds, 3),
                "valid_bleu_share": bleu_seconds / elapsed_s if elapsed_s else 0.0}

    # -- files -----------------------------------------------------------------------------

    def write(self, train_log: Path, valid_log: Path, valid_bleu_log: Path) -> None:
        """The three TSV files, each written atomically. The BLEU rows go to a file of their
        own too: a plot of valid_log.tsv would draw its empty BLEU cells (validation steps
        without BLEU) as zeros."""
        bleu = [(r.step, r.valid_bleu) for r in self.scored()]
        for path, names, rows in ((train_log, columns(TrainRow), map(astuple, self.train)),
                                  (valid_log, columns(ValidRow), map(astuple, self.valid)),
                                  (valid_bleu_log, ("step", "valid_bleu"), bleu)):
            lines = ["\t".join(names)] + ["\t".join(_cell(v) for v in row) for row in rows]
            with atomic_path(path) as tmp:
                tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _cell(v) -> str:
    if v is None:  # not measured at this step (BLEU between its passes)
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)
