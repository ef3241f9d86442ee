"""Table 3 of the paper, "Variations on the Transformer architecture", as experiments.

The paper's table (Vaswani et al., 2017, Section 6.2) varies its base model one group of
settings at a time and reports, on newstest2013, the perplexity per wordpiece, BLEU and the
parameter count; "unlisted values are identical to those of the base model", and Table 3
was decoded with beam search "but no checkpoint averaging". :data:`PAPER_ROWS` holds every
row with the paper's numbers.

Here a row is applied to *the current params*, whatever model they name (the paper's base
on WMT14, the multi30k preset's smaller one, the demo's): each row changes what the paper's
row changes, in the way the paper changes it, and leaves everything else as the params say.
Counts and probabilities are the paper's own values; sizes scale with the base, as the
paper's sizes are multiples of its base's d_model 512, d_ff 2048 and d_k 64:

======  =====================================================================================
row     what it sets, on top of the current params (d, d_ff, h, d_k: the current ones)
======  =====================================================================================
base    nothing
(A)     heads 1, 4, 16, 32 with d_k = d_v = d / heads (constant computation, Section 3.2.2)
(B)     d_k = d_k / 4 and d_k / 2 (the paper's 16 and 32 of 64), d_v kept
(C)     N = 2, 4, 8 layers in the encoder and in the decoder; d_model = d / 2 and 2d with
        d_k = d_v = d_model / h (heads kept); d_ff = d_ff / 2 and 2 d_ff
(D)     model.dropout 0.0 and 0.2; train.label_smoothing 0.0 and 0.2
(E)     learned positional embeddings instead of sinusoids
big     d_model 2d, d_ff 2 d_ff, heads 2h, dropout 0.3, and 3x the training (train.steps,
        and train.max_minutes where set; the paper's 300K steps against 100K)
======  =====================================================================================

On the paper's base these are exactly the paper's rows. On another base a row can equal
the base (multi30k has 4 heads: (A) h=4 is its base) or be impossible (heads that do not
divide d_model): :func:`build_rows` says so instead of queueing it. Experiments are named
after the paper's row (``table3-A-h1``, ``table3-C-d256``, ...) whatever the values they
get on the current base; the values are in each experiment's params.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from aiayn.config import Params, flatten, parse_params
from aiayn.errors import ParamsError
from aiayn.experiments.dvc_exps import Experiment
from aiayn.training.schedule import deep_post_ln_warning

PREFIX = "table3-"

# The paper's base row: N, d_model, d_ff, h, d_k, d_v, P_drop, eps_ls, train steps.
PAPER_BASE = {"N": 6, "d_model": 512, "d_ff": 2048, "h": 8, "d_k": 64, "d_v": 64,
              "P_drop": 0.1, "eps_ls": 0.1, "steps": 100_000}


class RowError(ValueError):
    """A row that cannot be built on the current params (the reason is the message)."""


Build = Callable[[Params], dict[str, Any]]


@dataclass(frozen=True)
class PaperRow:
    """One row of the paper's Table 3: the values it lists (others are the base's), its
    dev perplexity (per wordpiece), dev BLEU, and parameters x 10^6 where printed."""

    name: str  # the experiment's name
    group: str  # base, A, B, C, D, E, big
    listed: dict[str, Any]
    ppl: float
    bleu: float
    params_m: int | None
    build: Build = field(compare=False, repr=False)

    @property
    def values(self) -> dict[str, Any]:
        """Every column of the paper's row: the listed values over the base's."""
        return {**PAPER_BASE, **self.listed}


def _model(p: Params) -> tuple[int, int, int, int, int]:
    m = p.model
    return (m.d_model, m.d_ff, m.heads, m.d_k or m.d_model // m.heads,
            m.d_v or m.d_model // m.heads)


def _divide(n: int, by: int, what: str) -> int:
    if n % by or n // by < 1:
        raise RowError(f"{what} {n} is not divisible by {by}")
    return n // by


def heads(h: int) -> Build:
    """(A): h heads at constant computation, d_k = d_v = d_model / h."""
    def build(p: Params) -> dict[str, Any]:
        d = p.model.d_model
        size = _divide(d, h, "d_model")
        return {"model.heads": h, "model.d_k": size, "model.d_v": size}
    return build


def key_size(fraction: int) -> Build:
    """(B): d_k divided by ``fraction``, d_v kept (its current size, written out)."""
    def build(p: Params) -> dict[str, Any]:
        _, _, _, dk, dv = _model(p)
        return {"model.d_k": _divide(dk, fraction, "d_k"), "model.d_v": dv}
    return build


def layers(n: int) -> Build:
    """(C): N layers in the encoder and in the decoder."""
    def build(p: Params) -> dict[str, Any]:
        return {"model.encoder_layers": n, "model.decoder_layers": n}
    return build


def width(factor: float) -> Build:
    """(C): d_model times ``factor``, heads kept, d_k = d_v = d_model / h."""
    def build(p: Params) -> dict[str, Any]:
        d, _, h, _, _ = _model(p)
        new = int(d * factor)
        if new != d * factor or new < h:
            raise RowError(f"d_model {d} x {factor:g} is not a whole number of dimensions for "
                           f"{h} heads")
        size = _divide(new, h, "the new d_model")
        return {"model.d_model": new, "model.d_k": size, "model.d_v": size}
    return build


def inner(factor: float) -> Build:
    """(C): d_ff times ``factor``."""
    def build(p: Params) -> dict[str, Any]:
        d_ff = p.model.d_ff
        if d_ff * factor != int(d_ff * factor):
            raise RowError(f"d_ff {d_ff} x {factor:g} is not a whole number")
        return {"model.d_ff": int(d_ff * factor)}
    return build


def setting(key: str, value: Any) -> Build:
    """(D), (E): one setting to the paper's value."""
    def build(p: Params) -> dict[str, Any]:
        return {key: value}
    return build


def big(p: Params) -> dict[str, Any]:
    """big: twice d_model, d_ff and the heads (d_k, d_v as the base's), dropout 0.3, three
    times the training."""
    d, d_ff, h, _, _ = _model(p)
    out: dict[str, Any] = {"model.d_model": 2 * d, "model.d_ff": 2 * d_ff,
                           "model.heads": 2 * h, "model.dropout": 0.3,
                           "train.steps": 3 * p.train.steps}
    if p.train.max_minutes:
        out["train.max_minutes"] = 3 * p.train.max_minutes
    return out


def _row(name: str, group: str, listed: dict, ppl: float, bleu: float, params_m: int | None,
         build: Build) -> PaperRow:
    return PaperRow(PREFIX + name, group, listed, ppl, bleu, params_m, build)


# Table 3 as printed (checked against the NeurIPS 2017 PDF's text).
PAPER_ROWS: tuple[PaperRow, ...] = (
    _row("base", "base", {}, 4.92, 25.8, 65, lambda p: {}),
    _row("A-h1", "A", {"h": 1, "d_k": 512, "d_v": 512}, 5.29, 24.9, None, heads(1)),
    _row("A-h4", "A", {"h": 4, "d_k": 128, "d_v": 128}, 5.00, 25.5, None, heads(4)),
    _row("A-h16", "A", {"h": 16, "d_k": 32, "d_v": 32}, 4.91, 25.8, None, heads(16)),
    _row("A-h32", "A", {"h": 32, "d_k": 16, "d_v": 16}, 5.01, 25.4, None, heads(32)),
    _row("B-dk16", "B", {"d_k": 16}, 5.16, 25.1, 58, key_size(4)),
    _row("B-dk32", "B", {"d_k": 32}, 5.01, 25.4, 60, key_size(2)),
    _row("C-N2", "C", {"N": 2}, 6.11, 23.7, 36, layers(2)),
    _row("C-N4", "C", {"N": 4}, 5.19, 25.3, 50, layers(4)),
    _row("C-N8", "C", {"N": 8}, 4.88, 25.5, 80, layers(8)),
    _row("C-d256", "C", {"d_model": 256, "d_k": 32, "d_v": 32}, 5.75, 24.5, 28, width(0.5)),
    _row("C-d1024", "C", {"d_model": 1024, "d_k": 128, "d_v": 128}, 4.66, 26.0, 168, width(2)),
    _row("C-ff1024", "C", {"d_ff": 1024}, 5.12, 25.4, 53, inner(0.5)),
    _row("C-ff4096", "C", {"d_ff": 4096}, 4.75, 26.2, 90, inner(2)),
    _row("D-drop0.0", "D", {"P_drop": 0.0}, 5.77, 24.6, None, setting("model.dropout", 0.0)),
    _row("D-drop0.2", "D", {"P_drop": 0.2}, 4.95, 25.5, None, setting("model.dropout", 0.2)),
    _row("D-ls0.0", "D", {"eps_ls": 0.0}, 4.67, 25.3, None,
         setting("train.label_smoothing", 0.0)),
    _row("D-ls0.2", "D", {"eps_ls": 0.2}, 5.47, 25.7, None,
         setting("train.label_smoothing", 0.2)),
    _row("E-learned", "E", {"positions": "learned"}, 4.92, 25.7, None,
         setting("model.positions", "learned")),
    _row("big", "big", {"d_model": 1024, "d_ff": 4096, "h": 16, "P_drop": 0.3,
                        "steps": 300_000}, 4.33, 26.4, 213, big),
)
BASE = PREFIX + "base"  # the base row's experiment
GROUPS = ("base", "A", "B", "C", "D", "E", "big")


def select_rows(spec: str | None) -> list[PaperRow]:
    """The rows ``spec`` names: comma-separated groups (``A``, ``big``) or row names with or
    without the prefix (``C-N2``, ``table3-C-N2``); None or empty: every row. Paper order."""
    if not spec:
        return list(PAPER_ROWS)
    wanted = [s.strip() for s in spec.split(",") if s.strip()]
    if not wanted:
        raise ValueError(f"--rows {spec!r} names no row; give groups ({', '.join(GROUPS)}) "
                         "or row names (e.g. C-N2), or leave it out for all 20")
    names = {r.name for r in PAPER_ROWS}
    unknown = [w for w in wanted if w not in GROUPS and w not in names
               and PREFIX + w not in names]
    if unknown:
        raise ValueError(f"--rows: unknown {', '.join(unknown)}; give groups "
                         f"({', '.join(GROUPS)}) or row names (e.g. C-N2; all: "
                         f"{', '.join(r.name.removeprefix(PREFIX) for r in PAPER_ROWS)})")
    return [r for r in PAPER_ROWS
            if r.group in wanted or r.name in wanted or r.name.removeprefix(PREFIX) in wanted]


def nested(overrides: dict[str, Any]) -> dict[str, Any]:
    """{"model.heads": 1} → {"model": {"heads": 1}}."""
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        node = out
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def merge(base: dict, changes: dict) -> dict:
    out = dict(base)
    for key, value in changes.items():
        out[key] = merge(base.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def budget(steps: int | None = None, minutes: float | None = None) -> dict[str, Any]:
    """The overrides of a common training budget for every row: ``steps`` (and no time
    budget) or ``minutes`` (train.steps then stays a cap)."""
    if steps is not None and minutes is not None:
        raise ValueError("give --budget-steps or --budget-minutes, not both")
    if steps is not None:
        if steps < 1:
            raise ValueError(f"--budget-steps {steps}: must be at least 1")
        return {"train.steps": steps, "train.max_minutes": 0}
    if minutes is not None:
        if not minutes > 0:
            raise ValueError(f"--budget-minutes {minutes}: must be more than 0")
        return {"train.max_minutes": minutes}
    return {}


LENGTH = {"train.steps", "train.max_minutes"}  # how long a row trains


@dataclass
class PlannedRow:
    """A paper row built on the current params: its overrides, or why it cannot be built."""

    row: PaperRow
    overrides: dict[str, Any]
    error: str | None = None
    same_as_base: bool = False
    # What the trainer will warn about this row
    # (:func:`aiayn.training.schedule.deep_post_ln_warning`: on multi30k, C-N8's 8 + 8 post-LN
    # layers at the preset's rate), said when it is queued.
    warning: str | None = None


def _effective(p: Params) -> dict:
    """The params with d_k, d_v written out (0 means d_model / heads): what a run computes."""
    out = p.model_dump(mode="json")
    _, _, _, dk, dv = _model(p)
    out["model"].update(d_k=dk, d_v=dv)
    return out


def build_rows(raw: dict, rows: list[PaperRow], common: dict[str, Any] | None = None
               ) -> list[PlannedRow]:
    """Each row's overrides on top of the current params ``raw`` (params.yaml, parsed), with
    ``common`` (a budget, the user's --set) applied to every row, the base included. A row
    wins over ``common`` where both set a key, except for the training's length: where
    ``common`` sets train.steps or train.max_minutes, big takes that value too (and keeps
    its own for the one ``common`` does not set)."""
    common = common or {}
    base = parse_params(merge(raw, nested(common)), "params.yaml with the common overrides")
    base_dict = _effective(base)
    planned = []
    for row in rows:
        try:
            own = row.build(base)
        except RowError as exc:
            planned.append(PlannedRow(row, {}, f"{exc}"))
            continue
        # A length common sets holds for big too; the other stays big's (--set
        # train.max_minutes=0, no time budget, keeps big's 3x the steps).
        own = {k: v for k, v in own.items() if k not in LENGTH or k not in common}
        overrides = {**common, **own}
        try:
            built = parse_params(merge(raw, nested(overrides)), f"row {row.name}")
        except (ValueError, ParamsError) as exc:
            planned.append(PlannedRow(row, overrides, str(exc)))
            continue
        planned.append(PlannedRow(row, overrides,
                                  same_as_base=_effective(built) == base_dict
                                  and row.group != "base",
                                  warning=deep_post_ln_warning(built.model, built.train)))
    return planned


# -- the table ---------------------------------------------------------------------------------

@dataclass
class RowResult:
    """What one experiment of the table ran with and measured (its commit's files)."""

    params: dict[str, Any]  # flattened: "model.d_model" -> 512
    train: dict[str, Any]  # metrics/train.json
    bleu_valid: dict[str, Any]  # metrics/bleu_valid.json
    # The experiment's commit (DVC's rev of it), whose files :func:`save_runs` copies;
    # None for a run read from a folder. Not compared: the same results from either source.
    rev: str | None = field(default=None, compare=False)
    # A row that was not run because on the base's params it is the base (multi30k's A-h4):
    # these are the base's own results, put on its line by :func:`with_rows_equal_to_base`.
    same_as_base: bool = False


def results_from_experiments(experiments: Iterable[Experiment]) -> dict[str, RowResult]:
    """The table's finished experiments that have scores, by name, from
    :func:`aiayn.experiments.dvc_exps.read` with :data:`REQUIRED_RUN_FILES`; of two with one name,
    the first (DVC lists the newest first). An unfinished one (queued, running, failed,
    killed) is left out: DVC lists it with its baseline commit's metrics."""
    found: dict[str, RowResult] = {}
    for exp in experiments:
        if exp.baseline or not exp.name.startswith(PREFIX) or exp.name in found:
            continue
        train, valid = exp.files.get("metrics/train.json"), exp.files.get(
            "metrics/bleu_valid.json")
        if exp.finished and train and valid:
            found[exp.name] = RowResult(flatten(exp.files.get("params.yaml")), train, valid,
                                        exp.rev)
    return found


def results_from_folders(folders: list[Path]) -> dict[str, RowResult]:
    """The table's runs from run folders named after their rows (``table3-A-h1/``), each
    holding the params.yaml it ran with and the metrics/ its stages wrote (train.json,
    bleu_valid.json), as ``bench/gpu_session.sh`` runs them without DVC; folders that have
    not scored yet are left out."""
    found: dict[str, RowResult] = {}
    for folder in folders:
        folder = Path(folder)
        files = [folder / "params.yaml", folder / "metrics/train.json",
                 folder / "metrics/bleu_valid.json"]
        if not folder.name.startswith(PREFIX) or not all(f.is_file() for f in files):
            continue
        params, train, valid = (yaml.safe_load(f.read_text()) if f.suffix == ".yaml"
                                else json.loads(f.read_text()) for f in files)
        found[folder.name] = RowResult(flatten(params), train, valid)
    return found


def rows_equal_to_base(base: RowResult, rows: tuple[PaperRow, ...] = PAPER_ROWS) -> set[str]:
    """The rows that, built on the params the base row ran with, are the base itself (the
    same model and training: multi30k's (A) h=4 and (D) dropout 0.2); none where those
    params no longer parse."""
    try:
        planned = build_rows(nested(base.params), list(rows))
    except (ValueError, ParamsError):
        return set()
    return {plan.row.name for plan in planned if plan.same_as_base}


def with_rows_equal_to_base(results: dict[str, RowResult],
                            rows: tuple[PaperRow, ...] = PAPER_ROWS) -> dict[str, RowResult]:
    """``results`` with each row that equals the base (:func:`rows_equal_to_base`) and has
    not run filled in with the base's results, marked ``same_as_base``: one seed of one
    model trained once, shown on every line that names it (`aiayn table3 --queue` does not
    train it twice)."""
    base = results.get(BASE)
    if base is None:
        return dict(results)
    out = dict(results)
    for name in sorted(rows_equal_to_base(base, rows) - set(results)):
        out[name] = replace(base, rev=None, same_as_base=True)
    return out


# What a row's run folder holds: the files results_from_folders reads (the first three),
# then its curves and its averaging choice, as the train, average and score stages write them
# into the experiment's commit (all are git-tracked metrics, `cache: false` in dvc.yaml).
RUN_FILES = ("params.yaml", "metrics/train.json", "metrics/bleu_valid.json",
             "metrics/average.json", "metrics/train_log.tsv", "metrics/valid_log.tsv",
             "metrics/valid_bleu.tsv")
REQUIRED_RUN_FILES = RUN_FILES[:3]


class RunFolderError(ValueError):
    """A run folder that cannot be written (the message says which and what to do)."""


def save_runs(found: dict[str, RowResult], out: Path,
              read: Callable[[str, str], bytes | None]) -> list[Path]:
    """Write each row of ``found`` that came from a DVC experiment as a run folder,
    ``out/table3-<row>/`` with :data:`RUN_FILES` as they are in the experiment's commit
    (``read(rev, path)``: the file's bytes, None where the commit lacks it), in paper order.

    These are the folders :func:`results_from_folders` reads, so a table run in parts (on
    several days, machines, or commits, whose experiments `dvc exp show` no longer lists
    together) is assembled with `aiayn results --table3 --runs OUT/table3-*/`. A row whose
    folder exists already stops the whole call before anything is written (a run's record
    is not replaced silently); each folder appears complete or not at all.
    """
    from aiayn.io import atomic_path

    out = Path(out)
    order = {row.name: i for i, row in enumerate(PAPER_ROWS)}
    rows = sorted((name for name, r in found.items() if r.rev),
                  key=lambda name: order.get(name, len(order)))
    taken = [str(out / name) for name in rows if (out / name).exists()]
    if taken:
        raise RunFolderError(
            f"{', '.join(taken)}: already there; move or remove those folders (they may "
            "hold another run of the row), or save into another folder")
    files: dict[str, dict[str, bytes]] = {}
    for name in rows:
        rev = found[name].rev
        files[name] = {}
        for rel in RUN_FILES:
            data = read(rev, rel)
            if data is None and rel in REQUIRED_RUN_FILES:
                raise RunFolderError(f"{name}: experiment commit {rev[:7]} has no {rel}; "
                                     "was it run by `dvc exp run` with this pipeline?")
            if data is not None:
                files[name][rel] = data
    written = []
    for name in rows:
        with atomic_path(out / name, directory=True) as tmp:
            for rel, data in files[name].items():
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                (tmp / rel).write_bytes(data)
        written.append(out / name)
    return written


def _num(x: Any, digits: int = 2) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _probability(x: Any) -> str:
    """A probability as it was set, to 3 decimals, one at least (0.1, 0.0, 0.25)."""
    if not isinstance(x, (int, float)):
        return _num(x)
    text = f"{x:.3f}".rstrip("0")
    return text + "0" if text.endswith(".") else text


def _score(d: dict, key: str) -> float | None:
    value = d.get(key)
    return value.get("score") if isinstance(value, dict) else None


LABELS = {"base": "base", "A": "(A)", "B": "(B)", "C": "(C)", "D": "(D)", "E": "(E)",
          "big": "big"}


def our_columns(r: RowResult) -> list[str]:
    """N, d_model, d_ff, h, d_k, d_v, P_drop, eps_ls, positions, steps, PPL, BLEU,
    sacreBLEU, params."""
    p = r.params
    d, h = p.get("model.d_model"), p.get("model.heads")
    default = d // h if d and h else None
    n_enc, n_dec = p.get("model.encoder_layers"), p.get("model.decoder_layers")
    n = str(n_enc) if n_enc == n_dec else f"{n_enc}+{n_dec}"
    params, steps = r.train.get("parameters"), r.train.get("steps")
    return [n, _num(d), _num(p.get("model.d_ff")), _num(h),
            _num(p.get("model.d_k") or default), _num(p.get("model.d_v") or default),
            _probability(p.get("model.dropout")), _probability(p.get("train.label_smoothing")),
            {"learned": "learned"}.get(p.get("model.positions"), "sin"),
            "–" if steps is None else f"{steps:,}", _num(r.train.get("valid_ppl")),
            _num(_score(r.bleu_valid, "tokenized_bleu"), 1),
            _num(_score(r.bleu_valid, "sacrebleu"), 1),
            "–" if params is None else f"{params / 1e6:.3g}"]


HEADER = ("| row | N | d_model | d_ff | h | d_k | d_v | P_drop | ε_ls | positions | steps "
          "| PPL (dev) | BLEU (dev) | sacreBLEU (dev) | params ×10⁶ | paper: PPL (dev) "
          "| BLEU (dev) | params ×10⁶ |")


def render_table(results: dict[str, RowResult], rows: tuple[PaperRow, ...] = PAPER_ROWS,
                 title: str = "Table 3, reproduced") -> str:
    """The paper's layout as Markdown: one line per row with what our experiment ran with
    and measured (– where it has not run), beside the paper's dev PPL, BLEU and params."""
    lines = [f"# {title}", "",
             "Variations on the Transformer (Vaswani et al., 2017, Table 3), each row an "
             "experiment `aiayn table3 --queue` queued on the params of this repository: the "
             "row changes what the paper's row changes (aiayn/experiments/table3.py, "
             "docs/table3.md), everything else is as the params say. Our columns are what each "
             "experiment ran with and measured (positions: sinusoids or learned, row (E)); the "
             "last three are the paper's, on WMT14 newstest2013.", "",
             HEADER, "|" + "---|" * 18]
    for row in rows:
        label = f"{LABELS[row.group]} `{row.name}`"
        if row.name in results and results[row.name].same_as_base:
            label += " (= base)"
        ours = (our_columns(results[row.name]) if row.name in results
                else ["–"] * 10 + ["not run", "–", "–", "–"])
        paper = [f"{row.ppl:.2f}", f"{row.bleu:.1f}",
                 "" if row.params_m is None else str(row.params_m)]
        lines.append("| " + " | ".join([label, *ours, *paper]) + " |")
    lines += [
        "",
        "- PPL (dev): perplexity per target token of our BPE on the valid split, at the last "
        "validation of training (the label-smoothing-free NLL, exp'ed); the paper's is per "
        "wordpiece of its own 37k BPE on newstest2013. The two are not comparable across "
        "vocabularies: compare rows with rows.",
        "- BLEU (dev): tokenized BLEU (the paper's procedure, `aiayn score`) of the valid split "
        "translated by the averaged model with the params' `decode.*` settings; sacreBLEU beside "
        "it. The paper decoded Table 3 with beam search but without checkpoint averaging "
        "(`aiayn table3 --queue --set train.average_last=1 --set 'train.average_candidates=[]'` "
        "does the same here).",
        "- dev = our valid split (newstest2013 for WMT14, as the paper's).",
        "- params ×10⁶: our model's count (tied embeddings over our vocabulary); the paper's "
        "printed counts fit no single vocabulary size (tests/test_table3.py, docs/table3.md).",
    ]
    if same := [row.name for row in rows
                if row.name in results and results[row.name].same_as_base]:
        lines.append(f"- (= base): {', '.join(f'`{n}`' for n in same)} "
                     f"{'is' if len(same) == 1 else 'are'} the base on these params (the same "
                     "model and training), so the line repeats the base's run instead of "
                     "training it again.")
    if trained := trained_on(results, rows):
        lines.append(trained)
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Change:
    """One row against the base row: the change in dev BLEU (points) and in dev perplexity
    (relative), ours (None: not run, or the base has not) and the paper's."""

    name: str
    group: str
    bleu: float | None
    ppl: float | None
    paper_bleu: float
    paper_ppl: float
    same_as_base: bool = False  # the base's own run on the row's line (a change of 0)


def changes_from_base(results: dict[str, RowResult], rows: tuple[PaperRow, ...] = PAPER_ROWS
                      ) -> list[Change]:
    """Each row but the base against the base, ours beside the paper's: tokenized dev BLEU
    minus the base's, and dev perplexity over the base's minus 1. Perplexities of different
    vocabularies do not compare, but their ratios to a base on the same vocabulary do."""
    paper_base = next(r for r in PAPER_ROWS if r.group == "base")
    base = results.get(paper_base.name)
    base_bleu = _score(base.bleu_valid, "tokenized_bleu") if base else None
    base_ppl = base.train.get("valid_ppl") if base else None
    out = []
    for row in rows:
        if row.group == "base":
            continue
        ours = results.get(row.name)
        bleu = _score(ours.bleu_valid, "tokenized_bleu") if ours else None
        ppl = ours.train.get("valid_ppl") if ours else None
        out.append(Change(
            row.name.removeprefix(PREFIX), row.group,
            None if bleu is None or base_bleu is None else bleu - base_bleu,
            None if ppl is None or not base_ppl else ppl / base_ppl - 1,
            row.bleu - paper_base.bleu, row.ppl / paper_base.ppl - 1,
            ours is not None and ours.same_as_base))
    return out


def base_summary(results: dict[str, RowResult]) -> str:
    """The base row's dev BLEU and perplexity in words, for a caption ("–" where missing)."""
    base = results.get(BASE)
    bleu = _score(base.bleu_valid, "tokenized_bleu") if base else None
    ppl = base.train.get("valid_ppl") if base else None
    return ("base dev BLEU " + ("–" if bleu is None else f"{bleu:.1f}") + ", perplexity "
            + ("–" if ppl is None else f"{ppl:.2f}"))


def trained_on(results: dict[str, RowResult], rows: tuple[PaperRow, ...] = PAPER_ROWS
               ) -> str | None:
    """A note of what each row trained in and on (precision, hardware, processes, from its
    metrics/train.json), grouped, in paper order: rows run in parts on several machines
    differ in precision, which the table's columns do not show. None where no row says."""
    groups: dict[str, list[str]] = {}
    for row in rows:
        ran = results.get(row.name)
        train = ran.train if ran is not None and not ran.same_as_base else {}
        if not (train.get("precision") or train.get("hardware")):
            continue
        what = f"{train.get('precision', '?')} on {train.get('hardware') or '?'}"
        if (caps := train.get("instruction_caps")) not in (None, "none"):
            what += f" (capped to {caps})"
        if (world := train.get("world_size") or 1) > 1:
            what += f" × {world} processes"
        groups.setdefault(what, []).append(row.name.removeprefix(PREFIX))
    if not groups:
        return None
    return ("- trained in " + "; ".join(f"{what}: {', '.join(names)}"
                                        for what, names in groups.items())
            + " (each row's metrics/train.json).")


def paper_counts_implied_vocabulary(non_embedding: int, d_model: int, params_m: int
                                    ) -> tuple[float, float]:
    """The range of shared vocabulary sizes V for which non_embedding + V * d_model rounds
    to ``params_m`` millions (half-up, as printed)."""
    low = (params_m - 0.5) * 1e6 - non_embedding
    high = (params_m + 0.5) * 1e6 - non_embedding
    return max(low / d_model, 0.0), high / d_model


def rounds_to(count: int, params_m: int) -> bool:
    """Whether ``count`` parameters print as ``params_m`` x 10^6."""
    return math.floor(count / 1e6 + 0.5) == params_m
