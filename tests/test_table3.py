"""The paper's Table 3 as experiments: its rows on the current params, the parameter counts
against the paper's column, the `aiayn table3` command and the rendered table."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from aiayn.config import flatten, parse_params
from aiayn.errors import AiaynError
from aiayn.experiments import dvc_exps
from aiayn.experiments import table3 as t3
from aiayn.model import Transformer, count_parameters
from aiayn.training.build import model_config
from stages.params import compose
from stages.table3 import base_of, hydra_value
from tests.conftest import REPO

VOCAB = 37_000  # Section 5.1: "a shared source-target vocabulary of about 37000 tokens"


def composed(preset: str, *overrides: str) -> dict:
    return yaml.safe_load(compose(REPO / "conf", preset, list(overrides)))


def built(raw: dict, plan: t3.PlannedRow):
    return parse_params(t3.merge(raw, t3.nested(plan.overrides)))


def paper_columns(p) -> dict:
    """A row's params in the paper's columns."""
    m = p.model
    assert m.encoder_layers == m.decoder_layers
    return {"N": m.encoder_layers, "d_model": m.d_model, "d_ff": m.d_ff, "h": m.heads,
            "d_k": m.d_k or m.d_model // m.heads, "d_v": m.d_v or m.d_model // m.heads,
            "P_drop": m.dropout, "eps_ls": p.train.label_smoothing, "steps": p.train.steps,
            **({"positions": "learned"} if m.positions == "learned" else {})}


def test_the_rows_are_the_papers_table():
    assert len(t3.PAPER_ROWS) == 20 and len({r.name for r in t3.PAPER_ROWS}) == 20
    groups = [r.group for r in t3.PAPER_ROWS]
    assert {g: groups.count(g) for g in t3.GROUPS} == {"base": 1, "A": 4, "B": 2, "C": 7,
                                                       "D": 4, "E": 1, "big": 1}
    for row in t3.PAPER_ROWS:
        v = row.values
        if row.group == "A":  # constant computation (Section 3.2.2)
            assert v["h"] * v["d_k"] == v["h"] * v["d_v"] == 512
    assert {r.name: (r.ppl, r.bleu, r.params_m) for r in t3.PAPER_ROWS
            if r.group in ("base", "big")} == {"table3-base": (4.92, 25.8, 65),
                                               "table3-big": (4.33, 26.4, 213)}


def test_on_the_papers_base_every_row_is_the_papers_row():
    raw = composed("wmt14_base")
    for plan in t3.build_rows(raw, list(t3.PAPER_ROWS)):
        assert plan.error is None, plan
        assert paper_columns(built(raw, plan)) == plan.row.values, plan.row.name
    # (A) h=8 would be the base itself; none of the paper's rows is.
    assert not any(p.same_as_base for p in t3.build_rows(raw, list(t3.PAPER_ROWS)))


def plans(raw: dict, common: dict | None = None) -> dict[str, t3.PlannedRow]:
    return {p.row.name.removeprefix(t3.PREFIX): p
            for p in t3.build_rows(raw, list(t3.PAPER_ROWS), common)}


def test_on_multi30k_the_rows_vary_its_model_as_the_paper_varies_its_base():
    raw = composed("multi30k")  # d_model 256, 4 heads (d_k 64), 3 + 3 layers, d_ff 1024
    got = plans(raw)
    assert got["base"].overrides == {}
    assert got["A-h1"].overrides == {"model.heads": 1, "model.d_k": 256, "model.d_v": 256}
    assert got["A-h32"].overrides == {"model.heads": 32, "model.d_k": 8, "model.d_v": 8}
    assert got["A-h4"].same_as_base  # multi30k has 4 heads already
    assert got["B-dk16"].overrides == {"model.d_k": 16, "model.d_v": 64}
    assert got["C-N8"].overrides == {"model.encoder_layers": 8, "model.decoder_layers": 8}
    assert got["C-d256"].overrides == {"model.d_model": 128, "model.d_k": 32, "model.d_v": 32}
    assert got["C-ff4096"].overrides == {"model.d_ff": 2048}
    assert got["D-ls0.0"].overrides == {"train.label_smoothing": 0.0}
    assert got["E-learned"].overrides == {"model.positions": "learned"}
    assert got["big"].overrides == {"model.d_model": 512, "model.d_ff": 2048, "model.heads": 8,
                                    "model.dropout": 0.3, "train.steps": 3 * 8000,  # 300k / 100k
                                    "train.max_minutes": 165}
    # A common budget holds for every row, big included; the rest of big stays.
    budgeted = plans(raw, t3.budget(steps=500))
    assert budgeted["base"].overrides == {"train.steps": 500, "train.max_minutes": 0}
    assert budgeted["big"].overrides == {"train.steps": 500, "train.max_minutes": 0,
                                         "model.d_model": 512, "model.d_ff": 2048,
                                         "model.heads": 8, "model.dropout": 0.3}
    assert plans(raw, t3.budget(minutes=20))["big"].overrides["train.max_minutes"] == 20
    for plan in budgeted.values():
        assert plan.error is None and built(raw, plan).train.steps == 500


def test_a_row_that_cannot_be_built_says_why():
    raw = composed("multi30k", "model.d_model=80", "model.heads=4", "model.d_ff=512")
    got = plans(raw)
    assert got["A-h32"].error == "d_model 80 is not divisible by 32"
    assert got["A-h16"].overrides == {"model.heads": 16, "model.d_k": 5, "model.d_v": 5}
    assert got["B-dk16"].overrides == {"model.d_k": 5, "model.d_v": 20}  # 20 / 4
    raw = composed("multi30k", "model.d_model=12", "model.heads=4")  # d_k 3
    assert plans(raw)["B-dk16"].error == "d_k 3 is not divisible by 4"


def test_rows_are_chosen_by_group_or_name():
    assert [r.name for r in t3.select_rows("B,big")] == ["table3-B-dk16", "table3-B-dk32",
                                                         "table3-big"]
    assert [r.name for r in t3.select_rows("table3-C-N2, E-learned")] == [
        "table3-C-N2", "table3-E-learned"]
    assert len(t3.select_rows(None)) == 20
    with pytest.raises(ValueError, match="unknown F, C-N3"):
        t3.select_rows("F,C-N3")
    with pytest.raises(ValueError, match="names no row"):
        t3.select_rows(" , ")
    with pytest.raises(ValueError, match="not both"):
        t3.budget(steps=5, minutes=2)


# -- parameter counts ---------------------------------------------------------------------------

def counts() -> dict[str, tuple[int, int, int]]:
    """Each row on the paper's base with a 37,000-token shared vocabulary: (parameters,
    parameters outside the embedding, d_model); built on the meta device (no memory)."""
    raw = composed("wmt14_base")
    out = {}
    for plan in t3.build_rows(raw, list(t3.PAPER_ROWS)):
        cfg = model_config(built(raw, plan), VOCAB)
        with torch.device("meta"):
            n = count_parameters(Transformer(cfg))
        out[plan.row.name.removeprefix(t3.PREFIX)] = (n, n - VOCAB * cfg.d_model, cfg.d_model)
    return out


def test_parameter_counts_against_the_papers_column():
    """Our count of every row of Table 3 on a 37,000-token shared vocabulary, against the
    paper's column (millions, rounded as printed).

    Counted by hand (aiayn/model.py, Section 3): the one shared V x d_model matrix (source and
    target embeddings and the output projection, Section 3.4); per encoder layer the
    attention's four projections with biases (W_Q, W_K of h*d_k columns, W_V of h*d_v, W_O from
    h*d_v) + the FFN's W1, b1, W2, b2 + two LayerNorms (gain, bias); per decoder layer two
    attentions + FFN + three LayerNorms; no final LayerNorm (post-LN); sinusoids have no
    parameters. Base: 18,944,000 + 6 x 3,152,384 + 6 x 4,204,032 = 63,082,496.

    What is true: with V = 37,000 the base counts 63.1M, not the paper's 65M, and big
    214.2M, not 213M. No vocabulary size makes every printed count: base, (B) and (C) all
    print as the paper's for any V from 40,932 to 41,160 (41k rows of d_model, the only
    term that depends on V), while big needs V from 35,296 to 36,272. So the paper's column
    is not one count of this architecture over one vocabulary; we pin our counts and the
    vocabulary-free facts instead:

    - every row that keeps d_model differs from the base by what the paper's row differs, to
      its rounding (both printed numbers round by at most 0.5M: the differences agree within
      1M): (B) -7, -5; (C) N -29, -15, +15; d_ff -12, +25;
    - rows that change d_model differ from the base by their embedding too (V x Δd_model),
      so there the comparison is the V each printed count implies, above; (A), (D), (E)
      have no printed count ((A) keeps h x d_k = d_model: the base's count; (E) adds
      max_positions x d_model learned parameters, 524,288 at max_positions 1024).
    """
    c = counts()
    ours = {name: n for name, (n, _, _) in c.items()}
    assert ours["base"] == 63_082_496 and ours["big"] == 214_245_376
    assert {name: round(n / 1e6, 2) for name, n in ours.items()} == {
        "base": 63.08, "A-h1": 63.08, "A-h4": 63.08, "A-h16": 63.08, "A-h32": 63.08,
        "B-dk16": 55.99, "B-dk32": 58.35, "C-N2": 33.66, "C-N4": 48.37, "C-N8": 77.8,
        "C-d256": 26.83, "C-d1024": 163.89, "C-ff1024": 50.49, "C-ff4096": 88.27,
        "D-drop0.0": 63.08, "D-drop0.2": 63.08, "D-ls0.0": 63.08, "D-ls0.2": 63.08,
        "E-learned": 63.61, "big": 214.25}
    assert ours["E-learned"] - ours["base"] == 1024 * 512
    printed = {r.name.removeprefix(t3.PREFIX): r.params_m for r in t3.PAPER_ROWS
               if r.params_m is not None}
    # With V = 37,000 none prints as the paper's: base, (B), (C) are 1-4M short, big 1M over.
    assert not [n for n, m in printed.items() if t3.rounds_to(ours[n], m)]

    # Vocabulary-free: the difference from the base, for rows that keep d_model.
    same_width = [n for n in printed if n != "base" and c[n][2] == 512]
    assert same_width == ["B-dk16", "B-dk32", "C-N2", "C-N4", "C-N8", "C-ff1024", "C-ff4096"]
    for name in same_width:
        ours_m, paper_m = (ours[name] - ours["base"]) / 1e6, printed[name] - printed["base"]
        assert abs(ours_m - paper_m) < 1, (name, ours_m, paper_m)

    # The vocabulary each printed count implies for our architecture.
    implied = {n: t3.paper_counts_implied_vocabulary(c[n][1], c[n][2], m)
               for n, m in printed.items()}
    base_family = [n for n in implied if n != "big"]
    low = max(implied[n][0] for n in base_family)
    high = min(implied[n][1] for n in base_family)
    assert (round(low), round(high)) == (40_931, 41_161)  # one V fits base, (B), (C)
    for n in base_family:
        assert t3.rounds_to(c[n][1] + 41_000 * c[n][2], printed[n]), n
    big_low, big_high = implied["big"]
    assert (round(big_low), round(big_high)) == (35_296, 36_272)  # big alone: another V
    assert big_high < low and not big_low <= VOCAB < big_high


# -- the command's pieces -----------------------------------------------------------------------

@pytest.mark.parametrize("value, text", [
    (1, "1"), (0.3, "0.3"), (1e-9, "1e-09"), (True, "true"), (None, "null"),
    ("learned", "learned"), ("../corpora/multi30k", "../corpora/multi30k"),
    ("two words", "'two words'"), ("1.0", "'1.0'"), ([1, 3, 5], "[1,3,5]"), ([], "[]"),
    ({"train": "train", "valid": "val"}, "{train:train,valid:val}")])
def test_values_are_written_in_hydras_override_grammar(value, text):
    assert hydra_value(value) == text


def write_params(tmp_path: Path, preset: str, *overrides: str) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(compose(REPO / "conf", preset, list(overrides)))
    return path


def test_the_base_is_found_as_a_preset_and_overrides(tmp_path):
    conf = REPO / "conf"
    assert base_of(write_params(tmp_path, "multi30k"), conf, None) == ("multi30k", [])
    assert base_of(write_params(tmp_path, "demo"), conf, None) == ("demo", [])
    given = ["train.max_minutes=30", "train.average_candidates=[1,3]",
             "data.local.dir='my corpus/x'", "train.adam_eps=1e-08", "model.d_k=16"]
    preset, overrides = base_of(write_params(tmp_path, "multi30k", *given), conf, None)
    assert preset == "multi30k" and sorted(overrides) == sorted(given)
    assert base_of(write_params(tmp_path, "multi30k"), conf, "demo")[0] == "demo"


def test_params_that_no_preset_composes_stop_with_what_to_do(tmp_path):
    from aiayn.errors import ParamsError

    raw = composed("demo")
    del raw["model"]["d_k"]  # a params.yaml written by hand, not composed
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ParamsError, match="not the composition of .* `aiayn params PRESET"):
        base_of(path, REPO / "conf", None)


def test_the_dry_run_prints_each_rows_dvc_command(tmp_path, monkeypatch):
    from stages.cli import app

    monkeypatch.chdir(tmp_path)
    write_params(tmp_path, "multi30k", "train.max_minutes=30")
    (tmp_path / "conf").symlink_to(REPO / "conf")
    result = CliRunner().invoke(app, ["table3", "--dry-run", "--rows", "base,B,E,big",
                                      "--budget-steps", "300", "--set", "train.average_last=1"])
    assert result.exit_code == 0, result.output
    lines = [x for x in result.stdout.splitlines() if x.startswith("dvc ")]
    common = "-S experiment=multi30k -S train.steps=300 -S train.max_minutes=0 " \
             "-S train.average_last=1"
    assert lines == [
        f"dvc exp run --queue -n table3-base {common}",
        f"dvc exp run --queue -n table3-B-dk16 {common} -S model.d_k=16 -S model.d_v=64",
        f"dvc exp run --queue -n table3-B-dk32 {common} -S model.d_k=32 -S model.d_v=64",
        f"dvc exp run --queue -n table3-E-learned {common} -S model.positions=learned",
        f"dvc exp run --queue -n table3-big {common} -S model.d_model=512 -S model.d_ff=2048 "
        "-S model.heads=8 -S model.dropout=0.3"]
    assert "5 experiment(s)" in result.stdout
    # multi30k has 4 heads: its A-h4 is the base and is not queued to train it again.
    heads = CliRunner().invoke(app, ["table3", "--dry-run", "--rows", "A"])
    assert heads.exit_code == 0, heads.output
    assert [x.split()[5] for x in heads.stdout.splitlines() if x.startswith("dvc ")] == [
        "table3-A-h1", "table3-A-h16", "table3-A-h32"]
    assert "3 experiment(s)" in heads.stdout
    # C-N8's 8 + 8 post-LN layers at the preset's rate: the trainer's warning, said at once.
    layers = CliRunner().invoke(app, ["table3", "--dry-run", "--rows", "C-N4,C-N8"])
    assert layers.exit_code == 0, layers.output
    warned = [x for x in layers.output.splitlines() if "post-LN layers" in x]
    assert len(warned) == 1 and "table3-C-N8: 8 + 8 post-LN layers" in warned[0], warned
    bad = CliRunner().invoke(app, ["table3", "--rows", "Z"])
    assert bad.exit_code == 2 and "--rows: unknown Z" in bad.output


# -- the table ----------------------------------------------------------------------------------

# Rows as dvc.api.exp_show returns them (its columns, in its order; modelled on the rows DVC
# 3.67 gave for a real queue with finished, queued, running, failed and killed runs): the
# metrics and params cells flattened and turned into floats where they parse, "!" where DVC
# could not read a file, None where empty. The reader reads only Experiment, rev, typ,
# Created and State from them (and the "!"), and each finished experiment's files from its
# commit: COMMITS.
COLUMNS = ("Experiment", "rev", "typ", "Created", "parent", "State", "Executor",
           "metrics/train.json:steps", "valid_ppl", "parameters", "sacrebleu.score",
           "tokenized_bleu.score", "metrics/bleu_valid.json:steps", "seed", "model.d_model",
           "model.positions", "train.label_smoothing", "train.average_candidates")
DEMO = {"metrics/train.json:steps": 600.0, "valid_ppl": 1.27, "parameters": 80000.0,
        "sacrebleu.score": 88.1, "tokenized_bleu.score": 88.1,
        "metrics/bleu_valid.json:steps": 7.0, "seed": 1.0, "model.d_model": 32.0,
        "model.positions": "sinusoidal", "train.label_smoothing": 0.1,
        "train.average_candidates": "[1, 2]"}  # the baseline commit's cells (the demo's)


def shown(name: str | None, rev: str, state: str | None = None, typ: str = "branch_commit",
          created: str | None = "Jun 02, 2025", **cells) -> dict:
    """One row of dvc.api.exp_show: a baseline (typ "baseline") or an experiment of one,
    State as DVC gives it (Queued, Running, Failed, Success; None once the executor is
    gone); ``cells`` over the demo's (where DVC lists a baseline's metrics, or "!")."""
    executor = "Dvc-task" if state in ("Queued", "Running", "Success") else None
    return {**dict.fromkeys(COLUMNS), **DEMO, "Experiment": name, "rev": rev, "typ": typ,
            "Created": created, "State": state, "Executor": executor, **cells}


def files(model: dict, train_params: dict, train: dict, valid: dict) -> dict[str, bytes]:
    """A commit's params.yaml and metrics files, as `git show REV:PATH` gives them."""
    return {"params.yaml": yaml.safe_dump({"model": model, "train": train_params}).encode(),
            "metrics/train.json": json.dumps(train).encode(),
            "metrics/bleu_valid.json": json.dumps(valid).encode()}


ERRORED = dict.fromkeys(DEMO, "!")  # every file unreadable: DVC could not read the commit
ROWS = [
    shown(None, "workspace", typ="baseline", created=None),
    shown(None, "0123abc", typ="baseline"),
    # A running one is listed first, with the baseline's params and "!" for the metrics its
    # executor has not written yet.
    shown("table3-C-ff4096", "5555555", "Running", created=None,
          **dict.fromkeys(list(DEMO)[:6], "!")),
    shown("table3-base", "ba5e000", "Success", valid_ppl=5.4321, **{"model.d_model": 256.0}),
    shown("table3-B-dk16", "dk16000", **{"model.d_model": 256.0}),  # run by `dvc exp run`
    shown("table3-E-learned", "1ea4ed0", "Success", **{"model.positions": "learned"}),
    # Finished as DVC says, but its commit unreadable: a cell of "!", or no creation time.
    shown("table3-C-N4", "c4c4c4c", **ERRORED),
    shown("table3-C-N8", "c8c8c8c", created=None, **dict.fromkeys(DEMO)),
    shown("lr2", "1212121", "Success"),  # not the table's
    shown("table3-A-h1", "a1a1a1a", "Queued", **dict.fromkeys(list(DEMO)[:6])),
    # Killed by `dvc queue kill`, or failed: DVC lists the baseline commit's metrics.
    shown("table3-C-N2", "c2c2c2c", "Failed"),
    shown("table3-base", "ba5e999", "Failed", typ="branch_base"),  # an earlier try
    # An older commit's run of a row (exp_show with revs=, num= or -A): the newest is shown.
    shown(None, "fedcba9", typ="baseline"),
    shown("table3-base", "01d0000", typ="branch_base"),
]
DEMO_FILES = files({"d_model": 32}, {}, {"steps": 600, "valid_ppl": 1.27},
                   {"tokenized_bleu": {"score": 88.1}})
COMMITS = {
    "ba5e000": files({"d_model": 256, "heads": 4, "encoder_layers": 3, "decoder_layers": 3,
                      "d_ff": 1024, "d_k": 0, "d_v": 0, "dropout": 0.2,
                      "positions": "sinusoidal"},
                     {"label_smoothing": 0.3, "steps": 4000},
                     {"steps": 1750, "valid_ppl": 5.4321, "parameters": 9_876_543},
                     {"sacrebleu": {"score": 40.123}, "tokenized_bleu": {"score": 41.56}}),
    "dk16000": files({"d_model": 256, "heads": 4, "encoder_layers": 3, "decoder_layers": 2,
                      "d_ff": 1024, "d_k": 16, "d_v": 64, "dropout": 0.2,
                      "positions": "sinusoidal"},
                     {"label_smoothing": 0.3},
                     {"steps": 2000, "valid_ppl": 6.0, "parameters": 9_000_000},
                     {"sacrebleu": {"score": 38.0}, "tokenized_bleu": {"score": 39.04}}),
    "1ea4ed0": files({"d_model": 256, "heads": 4, "encoder_layers": 3, "decoder_layers": 3,
                      "d_ff": 1024, "dropout": 0.2, "positions": "learned"},
                     {"label_smoothing": 0.3},
                     {"steps": 12, "valid_ppl": 50.0, "parameters": 10_000_000},
                     {"sacrebleu": {"score": 1.0}, "tokenized_bleu": {"score": 1.25}}),
    "1212121": files({}, {}, {"steps": 1}, {"sacrebleu": {"score": 2.0}}),
    "01d0000": files({}, {}, {"steps": 1}, {"sacrebleu": {"score": 0.0}}),
    # The stash commits of queued, running and failed runs, and the unreadable ones, hold
    # the baseline commit's files: read, they would put the demo's scores on those rows.
    **{rev: DEMO_FILES for rev in ("0123abc", "fedcba9", "5555555", "c4c4c4c", "c8c8c8c",
                                   "a1a1a1a", "c2c2c2c", "ba5e999")},
}


def read_commit(rev: str, path: str) -> bytes | None:
    return COMMITS[rev].get(path)


def table_results(rows: list[dict] = ROWS) -> dict[str, t3.RowResult]:
    """`aiayn results --table3`'s rows: the reader on ``rows``, then the table's."""
    return t3.results_from_experiments(dvc_exps.read(
        t3.REQUIRED_RUN_FILES, rows=copy.deepcopy(rows), read_file=read_commit))


EXPECTED = """\
# T

Variations on the Transformer (Vaswani et al., 2017, Table 3), each row an experiment \
`aiayn table3 --queue` queued on the params of this repository: the row changes what the \
paper's row changes (aiayn/experiments/table3.py, docs/table3.md), everything else is as the \
params say. Our columns are what each experiment ran with and measured (positions: sinusoids or \
learned, row (E)); the last three are the paper's, on WMT14 newstest2013.

| row | N | d_model | d_ff | h | d_k | d_v | P_drop | ε_ls | positions | steps | PPL (dev) \
| BLEU (dev) | sacreBLEU (dev) | params ×10⁶ | paper: PPL (dev) | BLEU (dev) | params ×10⁶ |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
| base `table3-base` | 3 | 256 | 1024 | 4 | 64 | 64 | 0.2 | 0.3 | sin | 1,750 | 5.43 | 41.6 \
| 40.1 | 9.88 | 4.92 | 25.8 | 65 |
| (A) `table3-A-h1` | – | – | – | – | – | – | – | – | – | – | not run | – | – | – | 5.29 \
| 24.9 |  |
| (B) `table3-B-dk16` | 3+2 | 256 | 1024 | 4 | 16 | 64 | 0.2 | 0.3 | sin | 2,000 | 6.00 \
| 39.0 | 38.0 | 9 | 5.16 | 25.1 | 58 |
| (E) `table3-E-learned` | 3 | 256 | 1024 | 4 | 64 | 64 | 0.2 | 0.3 | learned | 12 | 50.00 \
| 1.2 | 1.0 | 10 | 4.92 | 25.7 |  |
"""


def test_the_table_in_the_papers_layout_from_experiment_results():
    found = table_results()
    assert sorted(found) == ["table3-B-dk16", "table3-E-learned", "table3-base"]
    rows = tuple(r for r in t3.PAPER_ROWS
                 if r.name in ("table3-base", "table3-A-h1", "table3-B-dk16", "table3-E-learned"))
    text = t3.render_table(found, rows, title="T")
    table, notes = text.split("\n\n- ", 1)
    assert table + "\n" == EXPECTED
    assert "per target token of our BPE" in notes and "not comparable" in notes
    assert "dev = our valid split" in notes
    assert "trained in" not in notes  # no row says what it trained on
    base = found["table3-base"]
    mixed = {
        "table3-base": t3.RowResult(base.params, {**base.train, "precision": "bf16",
                                                  "hardware": "CPU X"}, base.bleu_valid),
        "table3-E-learned": t3.RowResult(base.params, {
            **base.train, "precision": "fp32", "hardware": "CPU Y",
            "instruction_caps": "avx2"}, base.bleu_valid),
        "table3-B-dk16": t3.RowResult(base.params, {
            **base.train, "precision": "bf16", "hardware": "CPU X"}, base.bleu_valid),
        "table3-big": t3.RowResult(base.params, {
            **base.train, "precision": "bf16", "hardware": "GPU Z", "world_size": 8},
            base.bleu_valid)}
    assert t3.render_table(mixed).endswith(
        "\n- trained in bf16 on CPU X: base, B-dk16; fp32 on CPU Y (capped to avx2): "
        "E-learned; bf16 on GPU Z × 8 processes: big (each row's metrics/train.json).\n")
    whole = t3.render_table({}, title="T")
    assert whole.count(" not run ") == 20


def test_run_folders_give_the_same_rows_as_the_experiments(tmp_path):
    """bench/gpu_session.sh runs the rows without DVC, one folder each: the same results as
    `dvc exp show` gives for the experiments; folders that have not scored are left out."""
    import json

    import yaml

    from stages.cli import app

    shown = table_results()
    folders = []
    for name, result in shown.items():
        folder = tmp_path / name
        (folder / "metrics").mkdir(parents=True)
        params = {}
        for key, value in result.params.items():  # flattened back into sections
            section, _, leaf = key.partition(".")
            params.setdefault(section, {})[leaf] = value
        (folder / "params.yaml").write_text(yaml.safe_dump(params))
        (folder / "metrics/train.json").write_text(json.dumps(result.train))
        (folder / "metrics/bleu_valid.json").write_text(json.dumps(result.bleu_valid))
        folders.append(folder)
    unscored = tmp_path / "table3-A-h1"
    (unscored / "metrics").mkdir(parents=True)
    (unscored / "params.yaml").write_text("model: {}\n")
    other = tmp_path / "lr2"
    other.mkdir()
    found = t3.results_from_folders([*folders, unscored, other])
    assert found == shown
    out = tmp_path / "metrics/table3.md"
    result = CliRunner().invoke(app, ["results", "--table3", "--metrics", str(out.parent),
                                      *[a for f in folders for a in ("--runs", str(f))]])
    assert result.exit_code == 0, result.output
    # The base's params make A-h4 and D-drop0.2 the base: their lines repeat its run.
    assert out.read_text() == t3.render_table(t3.with_rows_equal_to_base(shown))
    assert "3 of 20 rows have run, 2 more equal the base" in result.output
    picture = out.with_suffix(".png")  # the base has run: each row's change is drawn
    assert picture.read_bytes().startswith(b"\x89PNG") and str(picture) in result.output


def test_each_rows_change_from_the_base_ours_beside_the_papers():
    found = table_results()
    changes = {c.name: c for c in t3.changes_from_base(found)}
    assert list(changes) == [r.name.removeprefix("table3-") for r in t3.PAPER_ROWS[1:]]
    dk16 = changes["B-dk16"]  # ours: 39.04 and 6.0 against the base's 41.56 and 5.4321
    assert dk16.bleu == pytest.approx(39.04 - 41.56)
    assert dk16.ppl == pytest.approx(6.0 / 5.4321 - 1)
    assert dk16.paper_bleu == pytest.approx(25.1 - 25.8)  # the paper's 25.1 against 25.8
    assert dk16.paper_ppl == pytest.approx(5.16 / 4.92 - 1)
    assert changes["E-learned"].bleu == pytest.approx(1.25 - 41.56)
    assert changes["big"].paper_bleu == pytest.approx(26.4 - 25.8)
    h1 = changes["A-h1"]  # not run: the paper's alone
    assert (h1.bleu, h1.ppl) == (None, None) and h1.paper_bleu == pytest.approx(-0.9)
    without_base = {k: v for k, v in found.items() if k != "table3-base"}
    assert all(c.bleu is None and c.ppl is None
               for c in t3.changes_from_base(without_base))


def test_rows_equal_to_the_base_are_found_from_the_bases_own_params():
    """On multi30k (4 heads, dropout 0.2) the paper's A-h4 and D-drop0.2 are the base; on
    the paper's base no row is."""
    def base_result(raw: dict) -> t3.RowResult:
        return t3.RowResult(flatten(raw), {"valid_ppl": 6.0}, {})

    assert t3.rows_equal_to_base(base_result(composed("multi30k"))) == {
        "table3-A-h4", "table3-D-drop0.2"}
    assert t3.rows_equal_to_base(base_result(composed("wmt14_base"))) == set()
    # 8 heads and dropout 0.1 on multi30k: then A-h4 is a change and no (D) dropout row is
    # the base.
    assert t3.rows_equal_to_base(base_result(composed(
        "multi30k", "model.heads=8", "model.dropout=0.1"))) == set()
    # Params this code no longer reads: none, rather than a guess.
    assert t3.rows_equal_to_base(t3.RowResult({"model.d_model": "wide"}, {}, {})) == set()


def test_a_row_equal_to_the_base_shows_the_bases_run_marked_and_a_change_of_zero():
    raw = composed("multi30k")
    base = t3.RowResult(flatten(raw), {"valid_ppl": 6.0, "steps": 1600, "precision": "bf16",
                                       "hardware": "cpu"},
                        {"tokenized_bleu": {"score": 38.9}, "sacrebleu": {"score": 37.0}},
                        rev="abc1234")
    drop = t3.RowResult(flatten(t3.merge(raw, {"model": {"dropout": 0.0}})),
                        {"valid_ppl": 9.0, "precision": "bf16", "hardware": "cpu"},
                        {"tokenized_bleu": {"score": 37.1}}, rev="def5678")
    # A run of a row that equals the base is kept as it is (a second seed, say).
    h4 = t3.RowResult(flatten(raw), {"valid_ppl": 6.1}, {"tokenized_bleu": {"score": 39.0}})
    found = {"table3-base": base, "table3-D-drop0.0": drop}
    filled = t3.with_rows_equal_to_base(found)
    assert found == {"table3-base": base, "table3-D-drop0.0": drop}  # not changed in place
    assert set(filled) == {"table3-base", "table3-D-drop0.0", "table3-A-h4",
                           "table3-D-drop0.2"}
    for name in ("table3-A-h4", "table3-D-drop0.2"):
        assert filled[name].same_as_base and filled[name].rev is None  # --save-runs skips it
        assert (filled[name].params, filled[name].train, filled[name].bleu_valid) == (
            base.params, base.train, base.bleu_valid)
    assert not filled["table3-base"].same_as_base
    assert t3.with_rows_equal_to_base({**found, "table3-A-h4": h4})["table3-A-h4"] is h4
    assert t3.with_rows_equal_to_base({"table3-D-drop0.0": drop}) == {"table3-D-drop0.0": drop}

    changes = {c.name: c for c in t3.changes_from_base(filled)}
    assert (changes["A-h4"].bleu, changes["A-h4"].ppl) == (0.0, 0.0)
    assert changes["A-h4"].same_as_base and not changes["D-drop0.0"].same_as_base
    assert changes["D-drop0.0"].bleu == pytest.approx(37.1 - 38.9)
    table = t3.render_table(filled)
    line = next(x for x in table.splitlines() if "`table3-A-h4`" in x)
    assert line.startswith("| (A) `table3-A-h4` (= base) | 3 | 256 | 1024 | 4 | 64 | 64 |")
    assert "| 38.9 | 37.0 |" in line
    assert "- (= base): `table3-A-h4`, `table3-D-drop0.2` are the base on these params" in table
    # What a row trained on names the rows that ran, not the copies of the base.
    assert "bf16 on cpu: base, D-drop0.0 (each row's" in table
    assert "(= base)" not in t3.render_table(found)
    assert t3.base_summary(filled) == "base dev BLEU 38.9, perplexity 6.00"
    assert t3.base_summary({}) == "base dev BLEU –, perplexity –"


def test_saved_run_folders_hold_each_experiments_files_and_give_the_same_rows(tmp_path):
    """`aiayn results --table3 --save-runs` (t3.save_runs): each scored row's files copied
    byte for byte from its experiment's commit into a folder of its own, in paper order;
    read back, the same rows. A row whose folder exists, or a commit without a file the
    table needs, stops the call before any folder is written."""
    import json

    shown = table_results()
    commits = {}
    for result in shown.values():
        params: dict = {}
        for key, value in result.params.items():
            section, _, leaf = key.partition(".")
            params.setdefault(section, {})[leaf] = value
        commits[result.rev] = {
            "params.yaml": yaml.safe_dump(params).encode(),
            "metrics/train.json": json.dumps(result.train).encode(),
            "metrics/bleu_valid.json": json.dumps(result.bleu_valid).encode(),
            "metrics/valid_bleu.tsv": f"step\tvalid_bleu\n200\t{len(result.rev)}\n".encode(),
            "dvc.lock": b"not a run file"}
    reads = []

    def read(rev: str, path: str) -> bytes | None:
        reads.append((rev, path))
        return commits[rev].get(path)

    saved = t3.save_runs(shown, tmp_path / "runs", read)
    assert [p.name for p in saved] == ["table3-base", "table3-B-dk16", "table3-E-learned"]
    for folder in saved:
        files = commits[shown[folder.name].rev]
        on_disk = {str(f.relative_to(folder)): f.read_bytes()
                   for f in folder.rglob("*") if f.is_file()}
        assert on_disk == {k: v for k, v in files.items() if k in t3.RUN_FILES}
    assert t3.results_from_folders(saved) == shown
    assert sorted(os.listdir(tmp_path / "runs")) == sorted(p.name for p in saved)  # no leftovers

    taken = tmp_path / "taken"
    (taken / "table3-E-learned").mkdir(parents=True)
    reads.clear()
    with pytest.raises(t3.RunFolderError, match=r"table3-E-learned: already there"):
        t3.save_runs(shown, taken, read)
    assert reads == [] and os.listdir(taken) == ["table3-E-learned"]

    del commits[shown["table3-E-learned"].rev]["metrics/bleu_valid.json"]
    with pytest.raises(t3.RunFolderError, match=r"table3-E-learned: .* no "
                                                r"metrics/bleu_valid.json"):
        t3.save_runs(shown, tmp_path / "lacking", read)
    assert not (tmp_path / "lacking").exists()
    folders_only = t3.results_from_folders(saved)
    assert all(r.rev is None for r in folders_only.values())
    assert t3.save_runs(folders_only, tmp_path / "none", read) == []


def test_the_table_shows_probabilities_as_they_were_set():
    """P_drop and eps_ls of a base off the 0.1 grid print as set (0.25, 0.15), not rounded
    to a paper value; the paper's own values keep one decimal (0.1, 0.0)."""
    found = table_results()
    base = found["table3-base"]
    odd = t3.RowResult({**base.params, "model.dropout": 0.25, "train.label_smoothing": 0.15},
                       base.train, base.bleu_valid)
    zero = t3.RowResult({**base.params, "model.dropout": 0.0, "train.label_smoothing": 0.1},
                        base.train, base.bleu_valid)
    assert t3.our_columns(odd)[6:8] == ["0.25", "0.15"]
    assert t3.our_columns(zero)[6:8] == ["0.0", "0.1"]


def test_a_common_length_replaces_that_length_of_big_only():
    """--set train.max_minutes=0 (no time budget) leaves big its 3x the steps; a common
    train.steps gives big those steps and leaves it 3x the minutes; --budget-steps (both
    keys) makes big train what every row trains."""
    raw = composed("multi30k", "train.max_minutes=30")
    steps = parse_params(raw).train.steps

    def big(common: dict) -> dict:
        (plan,) = t3.build_rows(raw, t3.select_rows("big"), common)
        return {k: v for k, v in plan.overrides.items() if k in t3.LENGTH}

    assert big({}) == {"train.steps": 3 * steps, "train.max_minutes": 90}
    assert big({"train.max_minutes": 0}) == {"train.steps": 3 * steps, "train.max_minutes": 0}
    assert big({"train.steps": 1000}) == {"train.steps": 1000, "train.max_minutes": 90}
    assert big(t3.budget(steps=40)) == {"train.steps": 40, "train.max_minutes": 0}


def test_experiment_states_are_dvcs_and_an_unreadable_commit_is_a_failure():
    """A finished experiment has no executor (or one that says Success); a queued, running
    or failed one its executor's state; a finished one whose commit DVC could not read
    ("!" in a cell, or no creation time) failed. Of two with one name, the first: DVC lists
    finished ones before queued and failed ones, each newest first."""
    assert dvc_exps.states(dvc_exps.listed(ROWS)) == {
        "table3-C-ff4096": "Running", "table3-base": "Success", "table3-B-dk16": "Success",
        "table3-E-learned": "Success", "table3-C-N4": "Failed", "table3-C-N8": "Failed",
        "lr2": "Success", "table3-A-h1": "Queued", "table3-C-N2": "Failed"}
    listed = dvc_exps.listed(ROWS)
    assert [(e.name, e.rev) for e in listed if e.baseline] == [
        ("workspace", "workspace"), ("0123abc", "0123abc"), ("fedcba9", "fedcba9")]
    assert all(e.state == "Success" for e in listed if e.baseline)
    assert dvc_exps.states(dvc_exps.listed([])) == {}


def test_the_reader_reads_the_files_of_finished_experiments_and_baselines_only(
        tmp_path, monkeypatch):
    """Each finished experiment's and each commit's files from its commit, the workspace's
    from the working tree; a file the commit lacks is absent; none of an unfinished one
    (its commit holds the baseline's files)."""
    reads = []

    def read(rev: str, path: str) -> bytes | None:
        reads.append(rev)
        return read_commit(rev, path)

    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("model: {d_model: 8}\n")
    got = dvc_exps.read(["params.yaml", "metrics/bleu_valid.json"], rows=ROWS,
                           read_file=read)
    assert [e.name for e in got] == [r["Experiment"] or r["rev"] for r in ROWS]
    assert got[0].files == {"params.yaml": {"model": {"d_model": 8}}}  # the workspace
    assert got[3].files["params.yaml"]["model"]["d_model"] == 256  # an int, as written
    assert got[3].files["metrics/bleu_valid.json"]["tokenized_bleu"] == {"score": 41.56}
    assert set(reads) == {"0123abc", "ba5e000", "dk16000", "1ea4ed0", "1212121", "fedcba9",
                          "01d0000"}
    assert all(not e.files for e in got if not e.finished)
    assert dvc_exps.read(["metrics/absent.json"], rows=ROWS, read_file=read)[3].files == {}
    assert dvc_exps.read(rows=ROWS, read_file=read)[3].files == {}  # no files asked
    COMMITS["1212121"]["metrics/broken.json"] = b"{"
    with pytest.raises(AiaynError, match=r"lr2 \(commit 1212121\): "
                                                     r"metrics/broken.json does not parse"):
        dvc_exps.read(["metrics/broken.json"], rows=ROWS, read_file=read)
    del COMMITS["1212121"]["metrics/broken.json"]


def test_the_reader_on_a_real_repository(tmp_path, monkeypatch):
    """A git + DVC repository with one saved experiment: dvc.api.exp_show's rows have the
    columns the fixtures above have, the baseline is named by its commit (DVC shows its
    branch), and the experiment's files are its commit's."""
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    git = ["git", "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "params.yaml").write_text("model: {d_model: 32, positions: sinusoidal}\n")
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics/train.json").write_text('{"steps": 8, "valid_ppl": 3.5}')
    (tmp_path / "dvc.yaml").write_text("metrics: [metrics/train.json]\n")
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "base"], check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout[:7]
    (tmp_path / "params.yaml").write_text("model: {d_model: 64, positions: learned}\n")
    (tmp_path / "metrics/train.json").write_text('{"steps": 8, "valid_ppl": 2.5}')
    subprocess.run([sys.executable, "-m", "dvc", "exp", "save", "-q", "-n", "table3-E-learned"],
                   check=True)
    rows = dvc_exps.exp_show(dvc_exps.dvc_root())
    assert [list(r)[:7] for r in rows] == [list(COLUMNS[:7])] * 3
    assert [(r["Experiment"], r["typ"], r["State"]) for r in rows] == [
        (None, "baseline", None), (None, "baseline", None),
        ("table3-E-learned", "branch_base", None)]
    assert rows[2]["model.d_model"] == 64.0  # DVC's cells: floats
    got = dvc_exps.read(["params.yaml", "metrics/train.json"])
    assert [(e.name, e.state, e.baseline) for e in got] == [
        ("workspace", "Success", True), (head, "Success", True),
        ("table3-E-learned", "Success", False)]
    assert got[1].files["params.yaml"] == {"model": {"d_model": 32, "positions": "sinusoidal"}}
    assert got[2].files == {"params.yaml": {"model": {"d_model": 64, "positions": "learned"}},
                            "metrics/train.json": {"steps": 8, "valid_ppl": 2.5}}
    assert dvc_exps.git_file(got[2].rev, "metrics/absent.json") is None


def test_results_runs_name_a_missing_folder_and_count_rows_only(tmp_path):
    from stages.cli import app

    missing = CliRunner().invoke(app, ["results", "--table3", "--metrics", str(tmp_path),
                                       "--runs", str(tmp_path / "table3-base")])
    assert missing.exit_code == 2 and "no such folder" in missing.output
    assert not (tmp_path / "table3.md").exists()
    other = tmp_path / "table3-Z"
    (other / "metrics").mkdir(parents=True)
    (other / "params.yaml").write_text("model: {}\n")
    for f in ("train.json", "bleu_valid.json"):
        (other / "metrics" / f).write_text('{"steps": 1}')
    shown = CliRunner().invoke(app, ["results", "--table3", "--metrics", str(tmp_path),
                                     "--runs", str(other)])
    assert shown.exit_code == 0, shown.output
    assert "not named after a row" in shown.output
    assert "(0 of 20 rows have run" in shown.output
    assert not (tmp_path / "table3.png").exists()  # no base row: nothing to compare with


def test_results_table3_outside_a_dvc_repository_says_so_and_writes_nothing(tmp_path,
                                                                              monkeypatch):
    """`aiayn results --table3` and `aiayn table3 --queue` read the experiments through
    aiayn.experiments.dvc_exps: outside a DVC repository, its error and the fix, exit 2."""
    from stages.cli import app

    monkeypatch.chdir(tmp_path)
    failed = CliRunner().invoke(app, ["results", "--table3", "--metrics", str(tmp_path)])
    assert failed.exit_code == 2, failed.output
    assert f"{tmp_path}: not inside a DVC repository; run this from the project's root" in (
        " ".join(failed.output.split()))
    assert not (tmp_path / "table3.md").exists()
    from stages.table3 import existing

    with pytest.raises(AiaynError, match="not inside a DVC repository"):
        existing()
    monkeypatch.setitem(sys.modules, "dvc.repo", None)  # DVC not installed: how to get it
    with pytest.raises(AiaynError, match=r"DVC is not installed .*\(source .venv/bin/activate\)"):
        existing()


def test_the_pictures_axis_cuts_an_outlier_only():
    """A row that did not train (perplexity +123,592%) would flatten every other bar: the
    axis ends at 1.15x the largest change within 20x the median, and only then."""
    from aiayn.plots import axis_cap

    changes = [4.0, -8.0, 12.0, 3.0, 40.0, 0.0, -5.0, 123_592.0]  # median |change| 8
    assert axis_cap(changes) == pytest.approx(1.15 * 40.0)
    assert axis_cap(changes[:-1]) is None  # no outlier: matplotlib's own limits
    assert axis_cap([]) is None and axis_cap([0.0, 0.0]) is None
    assert axis_cap([-0.5, 0.3, -38.9, 0.6]) == pytest.approx(1.15 * 0.6)
