"""bench/quality_curve.py: checkpoints built so that the right averages are a known model whose
translations are the references (scores of 100), the chosen steps, the averaged counts and
the training minutes of each point, and its TSV and PNG."""

from __future__ import annotations

import csv

import matplotlib.image
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sacrebleu
import torch

from aiayn.beam import BeamConfig
from aiayn.corpus import iter_raw
from aiayn.model import Transformer, TransformerConfig
from aiayn.tokenizer import load_tokenizer
from aiayn.translation import Translator
from bench import quality_curve as quality
from tests.conftest import write_params

DECODE = {"beam": 2, "alpha": 0.6, "max_len_a": 0.0, "max_len_b": 8, "batch_size": 4}
STEPS = (2, 4, 6, 8, 10)
# The train log: elapsed seconds at logged steps 3, 6, 9, 12.
LOGGED = {3: 30.0, 6: 66.0, 9: 90.0, 12: 150.0}


@pytest.fixture(scope="module")
def curve_run(toy_workspace, tmp_path_factory) -> dict:
    """Checkpoints at STEPS of three untrained models M, R, N:  2M-R, R, R, 2M-R, 2N-(2M-R).

    The mean of the last two checkpoints is M at steps 4 and 8 and N at step 10, while no
    single checkpoint is M. The test split's references are M's own translations, so a
    point decoded with M scores 100 and any other model less.
    """
    root = tmp_path_factory.mktemp("curve")
    tokenizer = toy_workspace / "data/vocab/tokenizer.json"
    tok = load_tokenizer(tokenizer)
    cfg = TransformerConfig(vocab_size=tok.get_vocab_size(), d_model=32, heads=4,
                            encoder_layers=1, decoder_layers=1, d_ff=64, max_positions=64)

    def weights(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        return Transformer(cfg).state_dict()

    def mix(a: float, x: dict, b: float, y: dict) -> dict:
        return {k: a * x[k] + b * y[k] for k in x}

    m, r, n = weights(25), weights(5), weights(3)
    states = [mix(2, m, -1, r), r, r, mix(2, m, -1, r), mix(2, n, -1, mix(2, m, -1, r))]
    checkpoints = root / "checkpoints"
    checkpoints.mkdir()
    for step, state in zip(STEPS, states, strict=True):
        torch.save({"model": state, "meta": {"model_config": cfg.to_dict()}},
                   checkpoints / f"step-{step:08d}.pt")

    def translate(state: dict, sources: list[str]) -> list[str]:
        model = Transformer(cfg).eval()
        model.load_state_dict(state)
        cfg_beam = BeamConfig(**{k: v for k, v in DECODE.items() if k != "batch_size"})
        return Translator(model, tok, torch.device("cpu")).translate(
            sources, cfg_beam, batch_size=DECODE["batch_size"], truncate=True)

    sources = [t for b in iter_raw(toy_workspace / "data/raw", "test") for t in b["en"]][:8]
    references = translate(m, sources)
    raw = root / "raw"
    raw.mkdir()
    pq.write_table(pa.table({"de": references, "en": sources}), raw / "test.parquet")
    (root / "train_log.tsv").write_text("step\tloss\tlr\telapsed_s\n" + "".join(
        f"{s}\t3.0\t0.001\t{e}\n" for s, e in LOGGED.items()))
    return {"root": root, "tokenizer": tokenizer, "references": references,
            "n_hyps": translate(n, sources),
            "params": write_params(root / "params.yaml", {"decode": DECODE})}


def argv(run: dict, *extra: str) -> list[str]:
    root = run["root"]
    return ["--params", str(run["params"]), "--checkpoints", str(root / "checkpoints"),
            "--tokenizer", str(run["tokenizer"]), "--raw", str(root / "raw"),
            "--train-log", str(root / "train_log.tsv"), *extra]


def minutes_near(step: int) -> float:
    """Elapsed minutes at the logged step nearest to ``step``."""
    nearest = min(LOGGED, key=lambda s: abs(s - step))
    return round(LOGGED[nearest] / 60, 2)


def test_points_decode_the_mean_of_the_last_checkpoints(curve_run, tmp_path, capsys):
    """Points averaging to M score 100 on M's references; the last scores N's, by sacrebleu."""
    # every 4th step and the last, each the mean of its last 2 checkpoints
    refs, n_hyps = curve_run["references"], curve_run["n_hyps"]
    assert max(len(r.split()) for r in refs) >= 4  # BLEU can reach 100: 4-grams exist
    assert len(set(refs)) >= 4  # sentences told apart: a pairing mix-up would lose points
    assert n_hyps != refs
    out = tmp_path / "curve.tsv"
    rows = quality.main(argv(curve_run, "--every", "4", "--average", "2", "--out", str(out)))
    assert [(r["step"], r["averaged"]) for r in rows] == [(4, 2), (8, 2), (10, 2)]
    assert [r["train_min"] for r in rows] == [minutes_near(s) for s in (4, 8, 10)]
    for row in rows[:2]:  # the mean of 2M-R and R, of R and 2M-R: M
        assert (row["sacrebleu"], row["chrf"], row["lc_tok_bleu"]) == (100.0, 100.0, 100.0)
    last = rows[2]  # the mean of 2M-R and 2N-(2M-R): N
    assert last["sacrebleu"] == round(sacrebleu.corpus_bleu(n_hyps, [refs]).score, 2)
    assert last["chrf"] == round(sacrebleu.corpus_chrf(n_hyps, [refs]).score, 2)
    assert last["lc_tok_bleu"] < 100.0
    with out.open(newline="") as f:
        written = list(csv.DictReader(f, delimiter="\t"))
    assert [{k: float(v) for k, v in w.items()} for w in written] == [
        {k: float(v) for k, v in r.items()} for r in rows]
    printed = capsys.readouterr().out
    assert "8 test sentences, en->de, beam 2, alpha 0.6, average 2, fp32" in printed


def test_without_averaging_no_single_checkpoint_is_the_reference_model(curve_run):
    """--average 1 (the default) decodes each checkpoint alone: none of them is M."""
    rows = quality.main(argv(curve_run, "--every", "4"))
    assert [(r["step"], r["averaged"]) for r in rows] == [(4, 1), (8, 1), (10, 1)]
    assert all(r["chrf"] < 100.0 for r in rows)


def test_fewer_checkpoints_are_averaged_at_the_start(curve_run, tmp_path):
    """--every 2 takes every checkpoint; the i-th (from 1) averages min(i, --average)."""
    png = tmp_path / "curve.png"
    rows = quality.main(argv(curve_run, "--every", "2", "--average", "3", "--png", str(png)))
    assert [r["step"] for r in rows] == list(STEPS)
    assert [r["averaged"] for r in rows] == [min(i, 3) for i in range(1, len(STEPS) + 1)]
    assert [r["train_min"] for r in rows] == [minutes_near(s) for s in STEPS]
    assert matplotlib.image.imread(png).shape[:2] == (4 * 110, 6 * 110)  # 6x4 in at 110 dpi


def test_an_empty_checkpoint_folder_is_an_error_naming_it(curve_run, tmp_path):
    """No checkpoints: the run stops naming the folder, and writes no TSV."""
    empty, out = tmp_path / "none", tmp_path / "curve.tsv"
    empty.mkdir()
    args = argv(curve_run, "--out", str(out))
    args[args.index("--checkpoints") + 1] = str(empty)
    with pytest.raises(SystemExit, match=f"error: no checkpoints in {empty}"):
        quality.main(args)
    assert not out.exists()
