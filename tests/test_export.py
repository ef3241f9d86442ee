"""Exported models compute what ours computes: CTranslate2 and transformers against aiayn.

The model is tiny but trained (a few seconds on the toy corpus), so that its outputs end
with EOS at varied lengths and beam search has real alternatives to choose from. Every
comparison is against our own model and beam search: token for token for the searches,
within 1e-4 for log-probabilities.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from aiayn.data.corpus import iter_raw
from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, encode_ids, load_tokenizer
from aiayn.decoding.beam import BeamConfig
from aiayn.decoding.translation import source_batch
from aiayn.errors import DataError, MissingPackageError
from aiayn.export.convert import (
    check_exportable,
    export,
    hidden_permutation,
    load_model_folder,
    marian_state_dict,
    require,
    token_strings,
)
from aiayn.export.model_card import model_card
from aiayn.model import Transformer, TransformerConfig
from stages.cli import app
from tests.conftest import save_model_folder as conftest_save_model_folder

ct2 = pytest.importorskip("ctranslate2")
transformers = pytest.importorskip("transformers")

MAX_LEN = 30  # one maximum output length for every engine and sentence
N_SENTENCES = 40


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def pad(rows: list[list[int]], pre: tuple[int, ...] = (), post: tuple[int, ...] = ()
        ) -> torch.Tensor:
    width = max(len(r) for r in rows) + len(pre) + len(post)
    out = torch.full((len(rows), width), PAD_ID)
    for i, r in enumerate(rows):
        out[i, :len(r) + len(pre) + len(post)] = torch.tensor([*pre, *r, *post])
    return out


def train_tiny(toy: Path, steps: int = 120, norm: str = "post") -> Transformer:
    """A 2+2-layer d_model 32 model after ``steps`` Adam steps on the toy corpus."""
    tok = load_tokenizer(toy / "data/vocab/tokenizer.json")
    pairs = [(en, de) for b in iter_raw(toy / "data/raw", "train")
             for en, de in zip(b["en"], b["de"], strict=True)]
    src = encode_ids(tok, [en for en, _ in pairs])
    tgt = encode_ids(tok, [de for _, de in pairs])
    torch.manual_seed(0)
    rng = random.Random(0)
    cfg = TransformerConfig(vocab_size=tok.get_vocab_size(), d_model=32, heads=4,
                            encoder_layers=2, decoder_layers=2, d_ff=64, dropout=0.0,
                            norm=norm, max_positions=64)
    model = Transformer(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3, betas=(0.9, 0.98))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only add overhead
    try:
        for _ in range(steps):
            idx = rng.sample(range(len(pairs)), 32)
            logits = model(pad([src[i] for i in idx], post=(EOS_ID,)),
                           pad([tgt[i] for i in idx], pre=(BOS_ID,)))
            labels = pad([tgt[i] for i in idx], post=(EOS_ID,))
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                   ignore_index=PAD_ID, label_smoothing=0.1)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def save_model_folder(model: Transformer, toy: Path, out: Path) -> Path:
    """``model`` as `aiayn average` writes a folder, with the toy workspace's tokenizer."""
    return conftest_save_model_folder(model, toy / "data/vocab/tokenizer.json", out,
                                      averaged_steps=[120])


@pytest.fixture(scope="module")
def model_dir(toy_workspace, tmp_path_factory) -> Path:
    return save_model_folder(train_tiny(toy_workspace),
                             toy_workspace, tmp_path_factory.mktemp("trained") / "model")


@pytest.fixture(scope="module")
def exports(model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exports")
    return {fmt: export(model_dir, root / fmt, fmt).directory
            for fmt in ("ctranslate2", "transformers")}


@pytest.fixture(scope="module")
def sources(toy_workspace, model_dir) -> list[list[int]]:
    tok = load_tokenizer(model_dir / "tokenizer.json")
    lines = [t for split in ("test", "valid") for b in iter_raw(toy_workspace / "data/raw", split)
             for t in b["en"]][:N_SENTENCES]
    return encode_ids(tok, lines)


@pytest.fixture(scope="module")
def engines(model_dir, exports):
    from aiayn.decoding.translation import load_translator
    from aiayn.export.engines import CTranslate2Translator, TransformersTranslator

    return {"aiayn": load_translator(model_dir, device="cpu"),
            "ctranslate2": CTranslate2Translator.from_folder(exports["ctranslate2"], threads=1),
            "transformers": TransformersTranslator.from_folder(exports["transformers"])}


def uniform(beam: int, alpha: float = 0.0, norm: str = "length") -> BeamConfig:
    return BeamConfig(beam=beam, alpha=alpha, max_len_a=0.0, max_len_b=MAX_LEN,
                      length_norm=norm)


def decode_all(translator, sources, cfg, batch_size: int = 16) -> list[list[int]]:
    out = []
    for start in range(0, len(sources), batch_size):
        out += translator.decode_batch(sources[start:start + batch_size], cfg)
    return out


@torch.no_grad()
def our_log_p(model: Transformer, sources, outputs) -> list[float]:
    """log P(output + EOS | source) under our model (PAD and BOS banned, as beam.py);
    an output of MAX_LEN tokens was cut there: no EOS."""
    totals = []
    for src, out in zip(sources, outputs, strict=True):
        target = out + [EOS_ID] if len(out) < MAX_LEN else out
        logits = model(source_batch([src]), torch.tensor([[BOS_ID] + target[:-1]])).float()[0]
        logits[:, [PAD_ID, BOS_ID]] = float("-inf")
        lp = F.log_softmax(logits, dim=-1)
        totals.append(float(lp[torch.arange(len(target)), torch.tensor(target)].sum()))
    return totals


# -- the mappings ----------------------------------------------------------------------------

@pytest.mark.parametrize("d_model", [8, 32, 512])
def test_the_permutation_turns_our_sinusoid_into_marians(d_model):
    from aiayn.model import sinusoidal_positions

    config = transformers.MarianConfig(vocab_size=8, d_model=d_model, encoder_layers=1,
                                       decoder_layers=1, encoder_attention_heads=1,
                                       decoder_attention_heads=1, encoder_ffn_dim=4,
                                       decoder_ffn_dim=4, max_position_embeddings=64,
                                       pad_token_id=0, eos_token_id=2,
                                       decoder_start_token_id=1)
    marian = transformers.MarianMTModel(config).model
    perm = hidden_permutation(d_model)
    assert sorted(perm.tolist()) == list(range(d_model))
    # Bit for bit: both tables are float64 sin/cos rounded once to float32.
    for side in (marian.encoder, marian.decoder):
        assert torch.equal(sinusoidal_positions(64, d_model)[:, perm],
                           side.embed_positions.weight.detach())


def test_marian_computes_our_log_probs_with_padding(model_dir):
    from aiayn.export.convert import to_marian

    folder = load_model_folder(model_dir)
    marian = to_marian(folder.model)
    src = pad([[5, 9, 33, 17, 81], [44, 12]], post=(EOS_ID,))
    tgt = pad([[7, 19, 23, 4], [61, 70]], pre=(BOS_ID,))
    with torch.no_grad():
        ours = folder.model(src, tgt)
        ours[..., [PAD_ID, BOS_ID]] = float("-inf")
        theirs = marian(input_ids=src, attention_mask=(src != PAD_ID).long(),
                        decoder_input_ids=tgt).logits
    assert torch.isinf(theirs[..., [PAD_ID, BOS_ID]]).all()
    allowed = torch.ones(ours.shape[-1], dtype=torch.bool)
    allowed[[PAD_ID, BOS_ID]] = False
    diff = (ours.log_softmax(-1) - theirs.log_softmax(-1))[..., allowed].abs().max()
    assert diff < 1e-5
    # Every weight of the state dict was used: a wrong key would have failed loading.
    assert set(marian_state_dict(folder.model)) <= set(marian.state_dict())


# -- the folders -----------------------------------------------------------------------------

def test_the_transformers_folder_loads_with_no_custom_code(exports, model_dir):
    folder = exports["transformers"]
    assert not list(folder.glob("*.py"))
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert type(model).__name__ == "MarianMTModel"
    assert tokenizer.is_fast and tokenizer.eos_token_id == EOS_ID
    ours = load_tokenizer(model_dir / "tokenizer.json")
    for text in ("The small dog sees the cat.", "Zwei  Leerzeichen, „Anführungszeichen“ — 3,14",
                 "A <pad> dog </s> runs."):  # text that spells a special token is text
        ids = ours.encode(text, add_special_tokens=False).ids
        assert tokenizer(text)["input_ids"] == ids + [EOS_ID]  # EOS on the source, as ours
        assert tokenizer.decode(ids + [EOS_ID], skip_special_tokens=True) == text  # lossless
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["decoder_start_token_id"] == BOS_ID
    assert generation["early_stopping"] == "never" and generation.get("forced_eos_token_id") is None


@pytest.mark.skipif(not transformers.__version__.startswith("4."),
                    reason="transformers 5 removed the translation pipeline")
def test_the_translation_pipeline_translates_as_we_do(exports, engines):
    pipe = transformers.pipeline("translation", model=str(exports["transformers"]))
    text = "A man reads a book because it rains."
    out = pipe(text, num_beams=1, max_new_tokens=MAX_LEN)[0]["translation_text"]
    assert out == engines["aiayn"].translate([text], uniform(1))[0]


def test_the_ctranslate2_folder_has_our_vocabulary_and_tokenizer(exports, model_dir):
    folder = exports["ctranslate2"]
    vocab = json.loads((folder / "shared_vocabulary.json").read_text())
    tok = load_tokenizer(model_dir / "tokenizer.json")
    assert vocab == token_strings(tok, tok.get_vocab_size())
    assert (folder / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    meta = json.loads((folder / "aiayn.json").read_text())
    assert meta["quantization"] == "none" and meta["check"]["max_abs_logprob_difference"] < 1e-4


def test_quantized_ctranslate2_exports_are_smaller_and_decode(model_dir, exports, tmp_path,
                                                               sources):
    from aiayn.export.engines import CTranslate2Translator

    out = export(model_dir, tmp_path / "int8", "ctranslate2", quantization="int8")
    full = (exports["ctranslate2"] / "model.bin").stat().st_size
    assert (out.directory / "model.bin").stat().st_size < 0.6 * full
    assert json.loads((out.directory / "aiayn.json").read_text())["quantization"] == "int8"
    int8 = CTranslate2Translator.from_folder(out.directory, threads=1)
    outputs = decode_all(int8, sources[:8], uniform(4))
    assert all(0 < len(o) <= MAX_LEN and PAD_ID not in o and BOS_ID not in o for o in outputs)


# -- exactness -------------------------------------------------------------------------------

def test_greedy_outputs_are_identical_across_engines(engines, sources):
    outputs = {name: decode_all(tr, sources, uniform(1)) for name, tr in engines.items()}
    ours = outputs["aiayn"]
    # Not vacuous: outputs of many lengths, most ending with EOS before the cut.
    assert len({len(o) for o in ours}) >= 5
    assert sum(len(o) < MAX_LEN for o in ours) >= 0.8 * len(ours)
    assert outputs["ctranslate2"] == ours
    assert outputs["transformers"] == ours


@pytest.mark.parametrize(("alpha", "norm"), [(0.0, "gnmt"), (0.6, "length"), (1.0, "length")])
def test_beam_outputs_are_identical_under_a_common_normalisation(engines, sources, alpha, norm):
    """alpha 0: no length normalisation, the same for every engine; alpha > 0: ours with
    |Y|^alpha, which the engines use. CTranslate2 stops after beam x patience finished
    hypotheses, an exact search only at alpha 0; with patience 1000 it searches on to the
    maximum length and returns what an exact search returns."""
    cfg = uniform(4, alpha, norm)
    ours = decode_all(engines["aiayn"], sources, cfg)
    assert ours != decode_all(engines["aiayn"], sources, uniform(1))  # the beam does search
    assert decode_all(engines["transformers"], sources, uniform(4, alpha)) == ours
    ct2_engine = engines["ctranslate2"]
    ct2_engine.patience = 1.0 if alpha == 0 else 1000.0
    try:
        assert decode_all(ct2_engine, sources, uniform(4, alpha)) == ours
    finally:
        ct2_engine.patience = 1.0


def test_beam_outputs_with_gnmt_differ_only_by_the_formula(engines, sources):
    """Ours with GNMT's normalisation against ours with |Y|^alpha: where they differ, each
    output scores best under its own formula (the searches themselves are exact)."""
    gnmt = decode_all(engines["aiayn"], sources, uniform(4, 0.6, "gnmt"))
    length = decode_all(engines["aiayn"], sources, uniform(4, 0.6, "length"))
    model = engines["aiayn"].model
    lp_g, lp_l = our_log_p(model, sources, gnmt), our_log_p(model, sources, length)
    for a, b, la, lb in zip(gnmt, length, lp_g, lp_l, strict=True):
        if a != b:
            n_a, n_b = len(a) + (len(a) < MAX_LEN), len(b) + (len(b) < MAX_LEN)
            assert la / ((5 + n_a) / 6) ** 0.6 >= lb / ((5 + n_b) / 6) ** 0.6 - 1e-5
            assert lb / n_b ** 0.6 >= la / n_a ** 0.6 - 1e-5


def test_log_probabilities_of_the_same_outputs_agree(engines, sources):
    """log P(output | source) of our beam outputs: teacher-forced by each engine, and as
    reported by each engine's own beam search, within 1e-4 of ours."""
    alpha = 0.6
    cfg = uniform(4, alpha)
    ours_engine, ct2_engine, hf = engines["aiayn"], engines["ctranslate2"], engines["transformers"]
    outputs = decode_all(ours_engine, sources, cfg)
    ours = our_log_p(ours_engine.model, sources, outputs)
    assert all(math.isfinite(x) for x in ours)
    vocab = ct2_engine.vocab

    # CTranslate2 scoring (appends EOS itself; our cut outputs have none, so skip those).
    ended = [i for i, o in enumerate(outputs) if len(o) < MAX_LEN]
    scored = ct2_engine.translator.score_batch(
        [[vocab[t] for t in sources[i]] + ["</s>"] for i in ended],
        [[vocab[t] for t in outputs[i]] for i in ended], max_input_length=0)
    assert max(abs(sum(r.log_probs) - ours[i]) for r, i in zip(scored, ended, strict=True)) < 1e-4

    # transformers teacher forcing.
    with torch.no_grad():
        for i, (src, out) in enumerate(zip(sources, outputs, strict=True)):
            target = out + [EOS_ID] if len(out) < MAX_LEN else out
            ids = torch.tensor([src + [EOS_ID]])
            logits = hf.model(input_ids=ids, decoder_input_ids=torch.tensor(
                [[BOS_ID] + target[:-1]])).logits[0].float()
            total = float(F.log_softmax(logits, -1)[torch.arange(len(target)),
                                                    torch.tensor(target)].sum())
            assert abs(total - ours[i]) < 1e-4

    # The searches' own scores: log P / |Y|^alpha, |Y| with EOS.
    ct2_engine.patience = 1000.0
    try:
        results = [r for s in range(0, len(sources), 16)
                   for r in ct2_engine.results(sources[s:s + 16], cfg, return_scores=True)]
    finally:
        ct2_engine.patience = 1.0
    gen = hf.generate(sources, cfg, output_scores=True, return_dict_in_generate=True)
    for i, out in enumerate(outputs):
        n = len(out) + (len(out) < MAX_LEN)
        assert abs(results[i].scores[0] * n ** alpha - ours[i]) < 1e-4
        assert abs(float(gen.sequences_scores[i]) * n ** alpha - ours[i]) < 1e-4


# -- the commands ----------------------------------------------------------------------------

def invoke(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200", "NO_COLOR": "1"})


def test_translate_with_each_engine_gives_our_text(model_dir, exports, toy_workspace):
    lines = ["The small dog sees the cat.", "", "A man reads a book because it rains."]
    params = str(toy_workspace / "params.yaml")
    texts = {}
    for engine, folder in (("aiayn", model_dir), ("ctranslate2", exports["ctranslate2"]),
                           ("transformers", exports["transformers"])):
        result = invoke("translate", *lines, "--params", params, "--engine", engine,
                        "--model", str(folder), "--beam", "4", "--alpha", "0.6",
                        "--length-norm", "length", "--no-progress", "--device", "cpu")
        assert result.exit_code == 0, result.output
        texts[engine] = result.stdout
    assert texts["aiayn"].count("\n") == 3 and texts["aiayn"].split("\n")[1] == ""
    assert texts["ctranslate2"] == texts["aiayn"] == texts["transformers"]
    # GNMT's formula is ours alone.
    result = invoke("translate", "Hello", "--params", params, "--engine", "ctranslate2",
                    "--model", str(exports["ctranslate2"]), "--length-norm", "gnmt")
    assert result.exit_code == 2 and "normalises beam scores by |Y|^alpha only" in result.output


def test_the_export_command_writes_a_model_card(model_dir, toy_workspace, tmp_path):
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    (metrics / "bleu.json").write_text(json.dumps({
        "split": "test", "sentences": 40,
        "sacrebleu": {"score": 12.345, "signature": "nrefs:1|case:mixed|eff:no|tok:13a"},
        "chrf": {"score": 40.0, "signature": "nrefs:1|nc:6"}}))
    (metrics / "vocab.json").write_text('{"size": 40')  # cut short: left out, with a warning
    out = tmp_path / "hf"
    result = invoke("export", "--format", "transformers", "--params",
                    str(toy_workspace / "params.yaml"), "--model", str(model_dir), "--out",
                    str(out), "--metrics", str(metrics))
    assert result.exit_code == 0, result.output
    card = (out / "README.md").read_text()
    assert "sacreBLEU | 12.3 |" in card and "nrefs:1\\|case:mixed\\|eff:no\\|tok:13a" in card
    assert "value: 12.35" in card and "language:\n- en\n- de" in card
    assert "not measured" in card  # no train.json, download.json here
    params = sum(p.numel() for p in load_model_folder(model_dir).model.parameters())
    assert f"{params:,}" in card


# -- bad input -------------------------------------------------------------------------------

def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_bad_requests_stop_with_one_line_and_write_nothing(model_dir, toy_workspace, tmp_path,
                                                           monkeypatch):
    params = str(toy_workspace / "params.yaml")
    out = tmp_path / "out"
    cases = [
        (["--format", "onnx"], "'onnx' is not one of 'ctranslate2', 'transformers'"),
        (["--format", "transformers", "--quantization", "int8"],
         "only the ctranslate2 format is quantized"),
        (["--format", "ctranslate2", "--model", str(tmp_path / "nowhere")],
         "no such model folder"),
    ]
    empty = tmp_path / "empty"
    empty.mkdir()
    cases.append((["--format", "ctranslate2", "--model", str(empty)],
                  "model.safetensors: missing"))
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    (no_config / "model.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes())
    cases.append((["--format", "transformers", "--model", str(no_config)], "config.json: missing"))
    for args, message in cases:
        result = invoke("export", "--params", params, "--out", str(out), *args)
        assert result.exit_code == 2, (args, result.output)
        assert message in " ".join(result.output.split()), (args, result.output)
        assert "Traceback" not in result.output
        assert not out.exists() and leftovers(tmp_path) == []

    # A missing optional package: what to install, in one line.
    monkeypatch.setitem(sys.modules, "ctranslate2", None)
    result = invoke("export", "--params", params, "--format", "ctranslate2", "--model",
                    str(model_dir), "--out", str(out))
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: the ctranslate2 format needs the Python package 'ctranslate2', which is not "
        "installed; install the export extras: pip install -e '.[export]' (from the "
        "repository's root)"]
    with pytest.raises(MissingPackageError, match=r"pip install -e '\.\[export\]'"):
        require("ctranslate2", "x")
    assert not out.exists()


def test_translate_with_a_missing_export_or_package_says_what_to_do(toy_workspace, tmp_path,
                                                                   monkeypatch):
    params = str(toy_workspace / "params.yaml")
    for engine in ("ctranslate2", "transformers"):
        result = invoke("translate", "Hello", "--params", params, "--engine", engine,
                        "--model", str(tmp_path))
        assert result.exit_code == 2
        assert f"not a folder of `aiayn export --format {engine}`" in result.output
    monkeypatch.setitem(sys.modules, "transformers", None)
    result = invoke("translate", "Hello", "--params", params, "--engine", "transformers")
    assert result.exit_code == 2 and "pip install -e '.[export]'" in result.output
    assert "Traceback" not in result.output


def test_pre_ln_cannot_become_marian_but_can_become_ctranslate2(toy_workspace, tmp_path):
    torch.manual_seed(1)
    tok = load_tokenizer(toy_workspace / "data/vocab/tokenizer.json")
    cfg = TransformerConfig(vocab_size=tok.get_vocab_size(), d_model=16, heads=2,
                            encoder_layers=1, decoder_layers=1, d_ff=32, norm="pre",
                            max_positions=32)
    with pytest.raises(DataError, match="MarianMT.*post-LN only.*--format ctranslate2"):
        check_exportable(cfg, "transformers")
    folder = save_model_folder(Transformer(cfg).eval(), toy_workspace, tmp_path / "pre")
    with pytest.raises(DataError, match="pre"):
        export(folder, tmp_path / "hf", "transformers")
    assert not (tmp_path / "hf").exists()
    # CTranslate2 has pre-LN (and the final LayerNorms): the export passes its own check.
    result = export(folder, tmp_path / "ct2", "ctranslate2")
    assert result.max_logprob_difference < 1e-4


def test_load_engine_passes_the_engines_own_options_on(toy_workspace, tmp_path):
    """load_engine(..., patience=...) opens a CTranslate2 export with that patience, which
    then goes to every translate_batch; the engines without such options refuse them."""
    from aiayn.export.engines import load_engine

    torch.manual_seed(2)
    tok = load_tokenizer(toy_workspace / "data/vocab/tokenizer.json")
    cfg = TransformerConfig(vocab_size=tok.get_vocab_size(), d_model=16, heads=2,
                            encoder_layers=1, decoder_layers=1, d_ff=32, max_positions=32)
    folder = save_model_folder(Transformer(cfg).eval(), toy_workspace, tmp_path / "model")
    ct2_dir = export(folder, tmp_path / "ct2", "ctranslate2").directory
    assert load_engine("ctranslate2", ct2_dir, device="cpu").patience == 1.0
    engine = load_engine("ctranslate2", ct2_dir, device="cpu", patience=7.0, threads=1)
    assert engine.patience == 7.0
    calls = []
    real = engine.translator.translate_batch
    engine.translator = type("Spy", (), {"translate_batch": staticmethod(
        lambda *a, **kw: calls.append(kw["patience"]) or real(*a, **kw))})()
    engine.translate(["The dog runs."], BeamConfig(beam=2, alpha=0, max_len_b=5))
    assert calls == [7.0]
    with pytest.raises(TypeError, match="patience"):
        load_engine("aiayn", folder, device="cpu", patience=7.0)


def test_a_failed_export_leaves_the_old_folder_as_it_was(model_dir, tmp_path, monkeypatch):
    import aiayn.export.convert as export_module

    out = tmp_path / "ct2"
    out.mkdir()
    (out / "old.txt").write_text("the previous export")
    (out / "aiayn.json").write_text("{}")

    def broken(*args, **kwargs):
        raise DataError("the check failed")

    monkeypatch.setattr(export_module, "check_export", broken)
    with pytest.raises(DataError, match="the check failed"):
        export(model_dir, out, "ctranslate2")
    assert sorted(p.name for p in out.iterdir()) == ["aiayn.json", "old.txt"]
    assert leftovers(tmp_path) == []


def test_the_model_card_says_not_measured_without_metrics():
    card = model_card("ctranslate2", {"model": {"d_model": 8}, "vocab_size": 100},
                      src_lang="de", tgt_lang="en", beam=4, alpha=0.6, parameters=1234,
                      quantization="int8", metrics={})
    assert "BLEU: not measured" in card and "Sentence pairs: not measured" in card
    assert "language:\n- de\n- en" in card and "model-index" not in card
    assert "quantized to int8" in card and "ctranslate2.Translator" in card
    assert "target side" not in card  # the paper's softmax over the shared vocabulary


def test_the_model_card_says_what_the_softmax_spans():
    card = model_card("ctranslate2", {"model": {"d_model": 8, "output_vocab": "target"},
                                      "vocab_size": 100},
                      src_lang="de", tgt_lang="en", beam=4, alpha=0.6, parameters=1234,
                      metrics={"train": {"output_vocab_size": 61, "steps": 5}})
    assert "softmax spans only the tokens that occur on the target side" in card
    assert "(61 tokens;" in card


def test_a_target_side_output_vocabulary_is_exported_as_the_output_bias(toy_workspace,
                                                                       tmp_path, sources):
    """model.output_vocab: target: both engines decode as we do, inside the vocabulary."""
    from aiayn.data.sampler import ShardDataset
    from aiayn.decoding.translation import load_translator
    from aiayn.export.engines import CTranslate2Translator, TransformersTranslator
    from aiayn.training.build import target_vocabulary

    torch.manual_seed(2)
    tok = load_tokenizer(toy_workspace / "data/vocab/tokenizer.json")
    cfg = TransformerConfig(vocab_size=tok.get_vocab_size(), d_model=16, heads=2,
                            encoder_layers=1, decoder_layers=1, d_ff=32, dropout=0.0,
                            max_positions=64, output_vocab="target")
    model = Transformer(cfg).eval()
    shards = toy_workspace / "data/shards"
    spanned = target_vocabulary([ShardDataset(shards / "train"), ShardDataset(shards / "valid")],
                                PAD_ID, BOS_ID)
    model.set_output_vocab(torch.from_numpy(spanned))
    folder = save_model_folder(model, toy_workspace, tmp_path / "model")
    dirs = {fmt: export(folder, tmp_path / fmt, fmt) for fmt in ("ctranslate2", "transformers")}
    assert all(r.max_logprob_difference < 1e-4 for r in dirs.values())
    engines = {"ctranslate2": CTranslate2Translator.from_folder(dirs["ctranslate2"].directory,
                                                                threads=1),
               "transformers": TransformersTranslator.from_folder(dirs["transformers"].directory)}
    ours = load_translator(folder, device="cpu")
    for cfg_ in (uniform(1), uniform(3)):
        want = decode_all(ours, sources[:12], cfg_)
        assert {t for out in want for t in out} <= set(spanned.tolist())
        for name, engine in engines.items():
            assert decode_all(engine, sources[:12], cfg_) == want, name


# -- Table 3's shapes: heads of other sizes (rows A, B), learned positions (row E) --------------

TABLE3_SHAPES = {  # name: settings on d_model 16, and whether Marian can express it
    "A: 1 head of 16": (dict(heads=1, d_k=16, d_v=16), True),
    "B: d_k 2 < d_v 8": (dict(heads=2, d_k=2, d_v=8), True),
    "d_k 8 > d_v 2": (dict(heads=2, d_k=8, d_v=2), True),
    "2 heads of 12 in 16": (dict(heads=2, d_k=12, d_v=12), False),
    "E: learned positions": (dict(heads=2, positions="learned"), False),
}


def shaped_folder(toy_workspace, tmp_path, settings: dict) -> Path:
    """An untrained model of those settings, its biases and positions random (zero biases
    would hide a wrongly mapped one), saved as `aiayn average` would."""
    tok = load_tokenizer(toy_workspace / "data/vocab/tokenizer.json")
    torch.manual_seed(3)
    cfg = TransformerConfig(vocab_size=tok.get_vocab_size(), d_model=16, encoder_layers=1,
                            decoder_layers=2, d_ff=32, dropout=0.0, max_positions=64,
                            **settings)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
    return save_model_folder(model, toy_workspace, tmp_path / "model")


@pytest.mark.parametrize("name", list(TABLE3_SHAPES))
def test_table3_shapes_export_exactly_or_say_why_not(name, toy_workspace, tmp_path, sources):
    from aiayn.decoding.translation import load_translator
    from aiayn.export.engines import CTranslate2Translator, TransformersTranslator

    settings, marian = TABLE3_SHAPES[name]
    folder = shaped_folder(toy_workspace, tmp_path, settings)
    ours = load_translator(folder, device="cpu")
    want = decode_all(ours, sources[:8], uniform(1))
    # CTranslate2 expresses every shape (a head_dim where heads x head != d_model).
    ct2_dir = export(folder, tmp_path / "ct2", "ctranslate2")
    assert ct2_dir.max_logprob_difference < 1e-4
    engine = CTranslate2Translator.from_folder(ct2_dir.directory, threads=1)
    assert decode_all(engine, sources[:8], uniform(1)) == want
    if marian:
        hf = export(folder, tmp_path / "hf", "transformers")
        assert hf.max_logprob_difference < 1e-4
        engine = TransformersTranslator.from_folder(hf.directory)
        assert decode_all(engine, sources[:8], uniform(1)) == want
    else:
        reason = ("learned position embeddings" if "positions" in settings
                  else "heads are d_model / heads wide")
        with pytest.raises(DataError, match=f"{reason}.*--format ctranslate2"):
            export(folder, tmp_path / "hf", "transformers")
        assert not (tmp_path / "hf").exists()


def test_the_model_card_names_the_head_sizes_and_positions():
    card = model_card("ctranslate2", {"model": {"d_model": 512, "heads": 8, "d_k": 16,
                                                "positions": "learned"}, "vocab_size": 100},
                      src_lang="de", tgt_lang="en", beam=4, alpha=0.6, parameters=1234,
                      metrics={})
    assert "| d_model | heads | d_k | d_v |" in card and "| 512 | 8 | 16 | 64 |" in card
    assert "learned positional embeddings" in card and "sinusoidal" not in card
    old = model_card("ctranslate2", {"model": {"d_model": 512, "heads": 8}, "vocab_size": 100},
                     src_lang="de", tgt_lang="en", beam=4, alpha=0.6, parameters=1234,
                     metrics={})  # a folder from before d_k, d_v, positions
    assert "| 512 | 8 | 64 | 64 |" in old and "sinusoidal positions" in old


def test_an_out_that_would_lose_data_is_refused_and_nothing_is_touched(model_dir, tmp_path):
    """The export replaces --out whole: a folder holding the model (`--out data` beside
    data/model), the model folder itself, or a folder that is not an earlier export is
    refused before any work, and stays as it was."""
    data = tmp_path / "data"
    shutil.copytree(model_dir, data / "model")
    (data / "raw").mkdir()
    (data / "raw" / "train.parquet").write_text("precious")
    before = sorted(str(p.relative_to(tmp_path)) for p in data.rglob("*"))
    for out, message in [(data, "holds the model folder"), (data / "model", "is the model folder"),
                         (data / "raw", "not an export")]:
        with pytest.raises(DataError, match=message):
            export(data / "model", out, "ctranslate2")
        assert sorted(str(p.relative_to(tmp_path)) for p in data.rglob("*")) == before
    # An earlier export (aiayn.json in it) is replaced; an empty folder is written into.
    first = export(data / "model", tmp_path / "ct2", "ctranslate2")
    export(data / "model", first.directory, "ctranslate2")
    (tmp_path / "empty").mkdir()
    assert (export(data / "model", tmp_path / "empty", "ctranslate2").directory
            / "aiayn.json").is_file()


@pytest.mark.parametrize("max_positions", [8, 12, 32])
def test_a_model_with_few_positions_exports_and_its_card_snippet_runs(toy_workspace, tmp_path,
                                                                       max_positions):
    """The export's probe fits the model's positions; the model card's CTranslate2 snippet
    caps decoding there (CTranslate2's default of 256 steps fails past the table: an
    untrained model writes no EOS), for a source that fits them."""
    import re
    import subprocess

    torch.manual_seed(0)
    tok = load_tokenizer(toy_workspace / "data/vocab/tokenizer.json")
    cfg = TransformerConfig(vocab_size=tok.get_vocab_size(), d_model=16, heads=2,
                            encoder_layers=1, decoder_layers=1, d_ff=32,
                            max_positions=max_positions)
    folder = save_model_folder(Transformer(cfg).eval(), toy_workspace, tmp_path / "model")
    for fmt in ("ctranslate2", "transformers"):
        assert export(folder, tmp_path / fmt, fmt).max_logprob_difference < 1e-4
    card = model_card("ctranslate2", load_model_folder(folder).config, src_lang="en",
                      tgt_lang="de", beam=4, alpha=0.6, parameters=1)
    snippet = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    assert f"max_decoding_length={max_positions})" in snippet
    if len(tok.encode("The house is small.").ids) + 1 > max_positions:
        return  # the snippet's source itself does not fit
    code = snippet.replace("DIR", str(tmp_path / "ctranslate2"))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_an_engine_given_another_kind_of_folder_or_tokenizer_says_so(model_dir, exports,
                                                                    toy_workspace, tmp_path):
    """One line, no traceback: an `aiayn average` folder given to the transformers engine, a
    CTranslate2 export without its vocabulary, a transformers export whose tokenizer is
    another's."""
    from aiayn.data.tokenizer import save_tokenizer, train_bpe

    params = str(toy_workspace / "params.yaml")
    ct2_dir = tmp_path / "ct2"
    shutil.copytree(exports["ctranslate2"], ct2_dir)
    (ct2_dir / "shared_vocabulary.json").unlink()
    hf_dir = tmp_path / "hf"
    shutil.copytree(exports["transformers"], hf_dir)
    save_tokenizer(train_bpe(["ganz andere woerter hier, viele"] * 50, 300, 2),
                   hf_dir / "tokenizer.json")
    for engine, folder, message in [
            ("transformers", model_dir, "no aiayn.json; this is not a folder of `aiayn export "
                                        "--format transformers`"),
            ("ctranslate2", ct2_dir, "no shared_vocabulary.json"),
            ("transformers", hf_dir, "do not belong together")]:
        result = invoke("translate", "Hello", "--params", params, "--engine", engine,
                        "--model", str(folder))
        assert result.exit_code == 2, (engine, result.output)
        assert message in " ".join(result.output.split()), (engine, result.output)
        assert "Traceback" not in result.output
