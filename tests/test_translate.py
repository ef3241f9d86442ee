"""Translation: order kept, empty lines, batching, limits, mismatches, the commands."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from aiayn.decoding.beam import BeamConfig
from aiayn.decoding.translation import ValidationBleu, decoding_model, load_translator
from aiayn.errors import DataError
from aiayn.model import Transformer, TransformerConfig
from tests.conftest import save_model_folder, write_params


@pytest.fixture
def model_dir(toy_workspace, tmp_path) -> Path:
    """An (untrained, deterministic) tiny model exported as `aiayn average` exports one."""
    from aiayn.data.tokenizer import load_tokenizer

    tok_path = toy_workspace / "data/vocab/tokenizer.json"
    torch.manual_seed(3)
    cfg = TransformerConfig(vocab_size=load_tokenizer(tok_path).get_vocab_size(), d_model=32,
                            heads=4, encoder_layers=1, decoder_layers=1, d_ff=64,
                            max_positions=40)
    model = Transformer(cfg)
    return save_model_folder(model, tok_path, tmp_path / "model")


LINES = ["The small dog sees the cat.", "", "A man reads a book because it rains.",
         "Today the woman helps the children in the big house.", "Hello", ""]


def test_order_empty_lines_and_batching(model_dir):
    tr = load_translator(model_dir)
    cfg = BeamConfig(beam=3, max_len_b=8)
    batched = tr.translate(LINES, cfg, batch_size=3)
    assert len(batched) == len(LINES)
    assert batched[1] == "" and batched[5] == ""
    singles = [tr.translate([line], cfg)[0] for line in LINES]
    assert batched == singles
    reordered = tr.translate(LINES[::-1], cfg, batch_size=2)
    assert reordered == batched[::-1]


def test_half_precision_decodes_a_converted_model_without_touching_the_original():
    """decoding_model: the weights in bf16 for decoding (no autocast casts then); a copy
    when asked, so that a model in training keeps its fp32 weights; nothing for fp32."""
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(vocab_size=40, d_model=16, heads=2,
                                          encoder_layers=1, decoder_layers=1, d_ff=32))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert decoding_model(model, None) is model
    copy = decoding_model(model, torch.bfloat16, copy=True)
    assert copy is not model and all(p.dtype == torch.bfloat16 for p in copy.parameters())
    for k, v in model.state_dict().items():
        assert v.dtype == before[k].dtype and torch.equal(v, before[k])
    assert decoding_model(copy, torch.bfloat16) is copy  # already in that dtype
    in_place = decoding_model(model, torch.bfloat16)
    assert in_place is model and model.embedding.weight.dtype == torch.bfloat16


def test_bf16_translation_and_validation_bleu(model_dir, toy_workspace):
    """load_translator --precision bf16 decodes a bf16 model (outputs for every line, empty
    lines kept); the validation hook decodes a bf16 copy and leaves the model it was given
    in fp32, its weights and its training mode as they were."""
    from aiayn.config import parse_params
    from aiayn.data.tokenizer import load_tokenizer

    tr = load_translator(model_dir, "cpu", "bf16")
    assert tr.model.embedding.weight.dtype == torch.bfloat16 and tr.amp_dtype == torch.bfloat16
    out = tr.translate(LINES, BeamConfig(beam=3, max_len_b=8), batch_size=2)
    assert len(out) == len(LINES) and out[1] == "" and out[5] == ""
    p = parse_params(yaml.safe_load((toy_workspace / "params.yaml").read_text()))
    p.train.valid_bleu_sentences = 5
    hook = ValidationBleu.from_params(p, toy_workspace / "data/raw",
                                      load_tokenizer(model_dir / "tokenizer.json"))
    model = load_translator(model_dir, "cpu", "fp32").model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    score = hook(model, torch.device("cpu"), torch.bfloat16)
    assert 0.0 <= score <= 100.0 and model.training
    for k, v in model.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, before[k])


def test_too_long_input_errors_or_truncates(model_dir):
    tr = load_translator(model_dir)
    long_line = " ".join(["word"] * 80)
    with pytest.raises(DataError, match="input line 2 has .* tokens, more than the model's "
                                        "limit of 39"):
        tr.translate(["short", long_line], BeamConfig(beam=1, max_len_b=3))
    out = tr.translate(["short", long_line], BeamConfig(beam=1, max_len_b=3), truncate=True)
    assert len(out) == 2


def test_model_and_tokenizer_mismatch(model_dir, tmp_path):
    from aiayn.data.tokenizer import save_tokenizer, train_bpe

    other = train_bpe(iter(["completely different text"] * 20), 300, 1)
    save_tokenizer(other, model_dir / "tokenizer.json")
    with pytest.raises(DataError, match="not the tokenizer this model was trained with"):
        load_translator(model_dir)


def test_translate_command_arguments_file_and_split(model_dir, toy_workspace, tmp_path,
                                                    monkeypatch):
    from stages.cli import app

    monkeypatch.chdir(tmp_path)
    params = write_params(tmp_path / "params.yaml", {"decode": {"beam": 2, "max_len_b": 6}})
    runner = CliRunner()
    base = ["translate", "--params", str(params), "--model", str(model_dir), "--no-progress"]
    res = runner.invoke(app, [*base, "The dog runs.", ""])
    assert res.exit_code == 0, res.output
    assert len(res.stdout.splitlines()) == 2 and res.stdout.splitlines()[1] == ""
    src = tmp_path / "in.txt"
    src.write_text("The dog runs.\n\nThe cat sleeps.\n")
    res = runner.invoke(app, [*base, "--input", str(src)])
    assert res.exit_code == 0 and len(res.stdout.splitlines()) == 3
    res = runner.invoke(app, [*base, "--split", "test", "--raw",
                              str(toy_workspace / "data/raw")])
    assert res.exit_code == 0, res.output
    written = (tmp_path / "data/translations/test.de").read_text().splitlines()
    assert len(written) == 40
    res = runner.invoke(app, [*base, "--max-len", "3", "--beam", "1", "The dog runs fast."])
    assert res.exit_code == 0
    from aiayn.data.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir / "tokenizer.json")
    assert len(tok.encode(res.stdout.splitlines()[0], add_special_tokens=False).ids) <= 3
    res = runner.invoke(app, [*base, "--input", str(tmp_path / "missing.txt")])
    assert res.exit_code == 2 and "no such file" in res.stderr


@pytest.mark.parametrize(("options", "expected"), [
    ([], BeamConfig(beam=5, alpha=0.8, max_len_a=1.5, max_len_b=7, length_norm="gnmt")),
    (["--beam", "2", "--alpha", "0", "--max-len-b", "0", "--max-len-a", "2"],
     BeamConfig(beam=2, alpha=0.0, max_len_a=2.0, max_len_b=0, length_norm="gnmt")),
    (["--max-len", "9", "--max-len-a", "3"],
     BeamConfig(beam=5, alpha=0.8, max_len_a=0.0, max_len_b=9, length_norm="gnmt")),
    (["--engine", "ctranslate2"],
     BeamConfig(beam=5, alpha=0.8, max_len_a=1.5, max_len_b=7, length_norm="length")),
    (["--engine", "transformers", "--length-norm", "gnmt", "--alpha", "0.5"],
     BeamConfig(beam=5, alpha=0.5, max_len_a=1.5, max_len_b=7, length_norm="gnmt")),
    (["--length-norm", "length"],
     BeamConfig(beam=5, alpha=0.8, max_len_a=1.5, max_len_b=7, length_norm="length")),
])
def test_translate_command_decodes_with_the_beam_config_from_decode_builds(
        tmp_path, monkeypatch, options, expected):
    """The settings `aiayn translate` decodes with, written out by hand from params'
    decode section and the options, are what BeamConfig.from_decode gives for them."""
    import aiayn.export.engines
    from aiayn.config import load_params
    from stages.cli import app

    used = []

    class Recorder:
        def translate(self, lines, cfg, batch_size, truncate, progress):
            used.append((cfg, batch_size))
            return list(lines)

    monkeypatch.setattr(aiayn.export.engines, "load_engine", lambda *a, **kw: Recorder())
    params = write_params(tmp_path / "params.yaml", {"decode": {
        "beam": 5, "alpha": 0.8, "max_len_a": 1.5, "max_len_b": 7, "batch_size": 3}})
    res = CliRunner().invoke(app, ["translate", "--params", str(params), "--no-progress",
                                   *options, "The dog runs."])
    assert res.exit_code == 0, res.output
    assert used == [(expected, 3)]
    given = dict(zip(options[::2], options[1::2], strict=True))
    engine = given.get("--engine", "aiayn")
    assert BeamConfig.from_decode(
        load_params(params).decode, beam=int(given.get("--beam", 0)) or None,
        alpha=float(given["--alpha"]) if "--alpha" in given else None,
        max_len_a=float(given["--max-len-a"]) if "--max-len-a" in given else None,
        max_len_b=int(given["--max-len-b"]) if "--max-len-b" in given else None,
        max_len=int(given["--max-len"]) if "--max-len" in given else None,
        length_norm=given.get("--length-norm", "gnmt" if engine == "aiayn" else "length"),
    ) == expected


@pytest.fixture
def checkpoint(toy_workspace, tmp_path) -> tuple[Path, Transformer]:
    """A training checkpoint of an (untrained, deterministic) tiny model, as `aiayn train`
    writes one, and that model."""
    from aiayn.data.tokenizer import load_tokenizer
    from aiayn.io import file_sha256
    from aiayn.training.checkpoint import save_checkpoint

    tok_path = toy_workspace / "data/vocab/tokenizer.json"
    torch.manual_seed(5)
    model = Transformer(TransformerConfig(
        vocab_size=load_tokenizer(tok_path).get_vocab_size(), d_model=32, heads=4,
        encoder_layers=1, decoder_layers=1, d_ff=64, max_positions=40)).eval()
    path = save_checkpoint(tmp_path / "checkpoints", 7, {
        "model": model.state_dict(), "step": 7,
        "meta": {"model_config": model.cfg.to_dict(), "vocab_size": model.cfg.vocab_size,
                 "tokenizer_sha256": file_sha256(tok_path), "step": 7}}, keep=1)
    return path, model


def test_a_checkpoint_translates_as_its_model_loaded_by_hand(checkpoint, toy_workspace):
    from aiayn.data.tokenizer import load_tokenizer
    from aiayn.decoding.translation import Translator, load_checkpoint_translator

    path, model = checkpoint
    tok_path = toy_workspace / "data/vocab/tokenizer.json"
    translator = load_checkpoint_translator(path, tok_path, device="cpu")
    cfg = BeamConfig(beam=3, max_len_b=8)
    by_hand = Translator(model, load_tokenizer(tok_path), torch.device("cpu"))
    expected = by_hand.translate(LINES, cfg, batch_size=2)
    assert any(expected), "every translation is empty: the comparison proves little"
    assert translator.translate(LINES, cfg, batch_size=2) == expected
    assert translator.model.cfg == model.cfg and not translator.model.training
    state = translator.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    bf16 = load_checkpoint_translator(path, tok_path, device="cpu", precision="bf16")
    assert bf16.model.embedding.weight.dtype == torch.bfloat16


def test_a_checkpoint_refuses_another_tokenizer(checkpoint, tmp_path):
    from aiayn.data.tokenizer import save_tokenizer, train_bpe
    from aiayn.decoding.translation import load_checkpoint_translator

    path, _ = checkpoint
    other = tmp_path / "other.json"
    save_tokenizer(train_bpe(iter(["completely different text"] * 20), 300, 1), other)
    with pytest.raises(DataError, match=r"other.json: sha256 .*/step-00000007.pt was trained "
                                        "with: the vocabulary changed since training"):
        load_checkpoint_translator(path, other)
    with pytest.raises(DataError, match="missing.json: no tokenizer"):
        load_checkpoint_translator(path, tmp_path / "missing.json")


def test_attention_command_writes_a_picture_per_kind_and_layer(model_dir, tmp_path):
    from stages.cli import app

    res = CliRunner().invoke(app, ["attention", "The small dog sees the cat.",
                                   "Der kleine Hund sieht die Katze.", "--model", str(model_dir),
                                   "--out", str(tmp_path / "maps")])
    assert res.exit_code == 0, res.output
    names = sorted(p.name for p in (tmp_path / "maps").iterdir())
    assert names == ["cross_layer1.png", "decoder_self_layer1.png", "encoder_self_layer1.png"]
    assert (tmp_path / "maps/cross_layer1.png").read_bytes()[:4] == b"\x89PNG"
    shutil.rmtree(tmp_path / "maps")


def test_input_that_is_not_utf8_names_the_file_and_line(model_dir, tmp_path, monkeypatch):
    from stages.cli import app

    monkeypatch.chdir(tmp_path)
    params = write_params(tmp_path / "params.yaml", {"decode": {"beam": 1, "max_len_b": 4}})
    base = ["translate", "--params", str(params), "--model", str(model_dir), "--no-progress"]
    src = tmp_path / "latin1.txt"
    src.write_bytes("The dog runs.\nThe café is open.\n".encode("latin-1"))
    out = tmp_path / "out.txt"
    res = CliRunner().invoke(app, [*base, "--input", str(src), "--out", str(out)])
    assert res.exit_code == 2
    assert f"{src}, line 2: invalid UTF-8" in res.stderr and "iconv" in res.stderr
    assert "Traceback" not in res.output and not out.exists()
    res = CliRunner().invoke(app, [*base, "--input", "-"], input="Le café\n".encode("latin-1"))
    assert res.exit_code == 2 and "standard input, line 1: invalid UTF-8" in res.stderr


def test_input_lines_are_split_at_newlines_only_as_the_score_stage_reads_them(
        model_dir, tmp_path, monkeypatch):
    """Form feed, U+2028, U+0085 and a lone CR are characters of a sentence, not line
    ends (sacreBLEU's command line and `wc -l` agree): 4 input lines, 4 output lines."""
    from aiayn.decoding.scoring import read_lines
    from stages.cli import app

    monkeypatch.chdir(tmp_path)
    params = write_params(tmp_path / "params.yaml", {"decode": {"beam": 1, "max_len_b": 4}})
    src = tmp_path / "in.txt"
    src.write_bytes("The dog runs.\r\nPage one\x0cpage two\nA line\u2028with LS\n"
                    "last\x85x\rend\n".encode())
    assert src.read_bytes().count(b"\n") == 4
    out = tmp_path / "out.txt"
    res = CliRunner().invoke(app, ["translate", "--params", str(params), "--model",
                                   str(model_dir), "--no-progress", "--input", str(src),
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert out.read_bytes().count(b"\n") == 4 and len(read_lines(out)) == 4


def test_a_line_break_in_a_translation_becomes_a_space(model_dir):
    """The byte-level vocabulary holds the newline byte, and a model may write it; the
    output stays one line per input line."""
    from aiayn.data.tokenizer import encode_ids

    tr = load_translator(model_dir)
    ids = encode_ids(tr.tokenizer, ["der Hund \nläuft\r\n schnell"])[0]
    tr.decode_batch = lambda sources, cfg: [ids for _ in sources]
    assert tr.translate(["a", "b"], BeamConfig()) == ["der Hund läuft schnell"] * 2
