"""bench/decode_batching.py: a short run on a tiny model folder, this checkout against the
code of HEAD as its baseline (both in child processes, as the benchmark runs), checked field
by field: every contender translates every line, batching changes no translation, and each
contender's sacreBLEU is sacreBLEU's own score of its outputs (no timing is asserted)."""

from __future__ import annotations

import json

import pytest
import sacrebleu
import torch

from aiayn.decoding.beam import BeamConfig
from aiayn.decoding.translation import load_translator
from aiayn.model import Transformer, TransformerConfig
from bench import decode_batching as db
from bench.harness import REPO
from tests.conftest import SENTENCES_DE, SENTENCES_EN, save_model_folder, usage_error


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from aiayn.data.tokenizer import save_tokenizer, train_bpe

    root = tmp_path_factory.mktemp("decode_batching")
    tok = train_bpe(SENTENCES_EN + SENTENCES_DE, vocab_size=300, min_frequency=1)
    save_tokenizer(tok, root / "tokenizer.json")
    torch.manual_seed(2)
    model = Transformer(TransformerConfig(vocab_size=tok.get_vocab_size(), d_model=32, heads=4,
                                          encoder_layers=1, decoder_layers=2, d_ff=64,
                                          max_positions=48)).eval()
    return save_model_folder(model, root / "tokenizer.json", root / "model")


def test_a_short_run_against_head(model_dir, tmp_path):
    inputs, refs = tmp_path / "in.en", tmp_path / "ref.de"
    lines = SENTENCES_EN[:7] + ["", "Hello"]
    inputs.write_text("\n".join(lines) + "\n")
    refs.write_text("\n".join(SENTENCES_DE[:7] + ["", "Hallo"]) + "\n")
    out = tmp_path / "r.json"
    db.main(["--model", str(model_dir), "--inputs", str(inputs), "--references", str(refs),
             "--baseline", "HEAD", "--batch-sizes", "2,4", "--beams", "1,3", "--rounds", "1",
             "--precision", "fp32", "--threads", "1", "--json", str(out)])
    record = json.loads(out.read_text())
    assert record["lines"] == len(lines) and record["precision"] == "fp32"
    translator = load_translator(model_dir, "cpu", "fp32")
    for beam in ("1", "3"):
        rows = record["beams"][beam]
        assert list(rows) == ["HEAD@2", "this@2", "this@4"]
        # each contender imported its own library: the baseline's extracted tree, this
        # checkout's aiayn/ (a turn started from the repository would import it for both)
        assert rows["HEAD@2"]["library"].endswith("/baseline0/aiayn")
        assert rows["this@2"]["library"] == str(REPO / "aiayn")
        expected = translator.translate(lines, BeamConfig(beam=int(beam), alpha=0.6),
                                        batch_size=64, truncate=True)
        bleu = sacrebleu.corpus_bleu(expected, [refs.read_text().splitlines()]).score
        for name, row in rows.items():
            assert len(row["seconds"]) == 1 and all(s > 0 for s in row["seconds"])
            assert row["same_outputs"] == len(lines), name
            assert row["sacrebleu"] == pytest.approx(bleu)
        assert rows["HEAD@2"]["speed"] == [1.0]


def test_bad_arguments_are_usage_errors(model_dir, tmp_path, capsys):
    assert "--model is required" in usage_error(lambda: db.main(["--inputs", "x"]), capsys)
    err = usage_error(lambda: db.main(["--model", str(tmp_path), "--inputs", "x"]), capsys)
    assert "no config.json" in err and "aiayn average" in err
    err = usage_error(lambda: db.main(["--model", str(model_dir), "--inputs",
                                       str(tmp_path / "missing.en")]), capsys)
    assert "missing.en: no such file" in err
