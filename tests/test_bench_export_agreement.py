"""bench/export_agreement.py: its log-probability of an output against a prefix-by-prefix
recomputation, and a run on a small untrained model exported to both engines: the counts
it reports follow its documented batching, and the engines agree with ours."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from aiayn.data.corpus import iter_raw
from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, encode_ids, load_tokenizer
from aiayn.decoding.beam import BeamConfig, beam_search
from aiayn.decoding.translation import source_batch
from aiayn.model import Transformer, TransformerConfig
from bench import export_agreement as agreement
from tests.conftest import save_model_folder

pytest.importorskip("ctranslate2")
pytest.importorskip("transformers")


def tiny_model(toy: Path, seed: int, eos_scale: float = 1.0) -> Transformer:
    """An untrained 1+1-layer model; ``eos_scale`` > 1 lengthens EOS's embedding row so
    that (through the tied projection) some outputs end before their length limit."""
    tok = load_tokenizer(toy / "data/vocab/tokenizer.json")
    torch.manual_seed(seed)
    model = Transformer(TransformerConfig(vocab_size=tok.get_vocab_size(), d_model=32, heads=4,
                                          encoder_layers=1, decoder_layers=1, d_ff=64,
                                          max_positions=40))
    with torch.no_grad():
        model.embedding.weight[EOS_ID] *= eos_scale
    return model.eval()


def save_folder(model: Transformer, toy: Path, out: Path) -> Path:
    """``model`` as `aiayn average` writes a folder, with the toy workspace's tokenizer."""
    return save_model_folder(model, toy / "data/vocab/tokenizer.json", out)


@pytest.fixture(scope="module")
def inputs(toy_workspace, tmp_path_factory) -> Path:
    """Ten test sentences with an empty and a blank line among them."""
    lines = [t for b in iter_raw(toy_workspace / "data/raw", "test") for t in b["en"]][:10]
    path = tmp_path_factory.mktemp("agreement") / "inputs.en"
    path.write_text("\n".join(lines[:3] + ["", "   "] + lines[3:]) + "\n", encoding="utf-8")
    return path


def test_our_log_p_is_the_sum_of_each_prefixs_next_token_log_probability(toy_workspace):
    """our_log_p equals a prefix-by-prefix sum, with EOS only below the limit, PAD/BOS banned."""
    model = tiny_model(toy_workspace, seed=5)
    sources = [[17, 40, 99, 23], [8, 300, 12], [250, 6], [77]]
    outputs = [[45, 46, 47], [101, 102], [], []]
    limits = [5, 2, 3, 0]  # ends early (+EOS), cut at its limit, only EOS, nothing at all

    def next_log_probs(src: list[int], prefix: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(source_batch([src]), torch.tensor([[BOS_ID] + prefix]))[0, -1]
        logits = logits.double()
        logits[[PAD_ID, BOS_ID]] = float("-inf")
        return torch.log_softmax(logits, -1)

    expected = []
    for src, out, limit in zip(sources, outputs, limits, strict=True):
        target = out + ([EOS_ID] if len(out) < limit else [])
        expected.append(sum(float(next_log_probs(src, target[:t])[token])
                            for t, token in enumerate(target)))
    assert expected[3] == 0.0  # an empty output at limit 0 has no token to score
    ours = agreement.our_log_p(model, sources, outputs, limits)
    assert ours == pytest.approx(expected, abs=1e-4)


def documented_counts(model: Transformer, ids: list[list[int]], batch_size: int, beam: int,
                      alpha: float, max_len_b: int) -> dict[str, int]:
    """Our decoder run as the docstring says the script runs it: sources sorted by length,
    batches of batch_size, one limit per batch (longest source + EOS + max_len_b)."""
    ids = sorted(ids, key=len)
    outs: dict[str, list] = {"greedy": [], "zero": [], "gnmt": [], "length": []}
    ended = 0
    for i in range(0, len(ids), batch_size):
        chunk = ids[i:i + batch_size]
        limit = min(max(map(len, chunk)) + 1 + max_len_b, model.cfg.max_positions)
        src = source_batch(chunk)
        for name, k, a, norm in (("greedy", 1, 0.0, "length"), ("zero", beam, 0.0, "gnmt"),
                                 ("gnmt", beam, alpha, "gnmt"),
                                 ("length", beam, alpha, "length")):
            outs[name] += beam_search(model, src, BeamConfig(beam=k, alpha=a, max_len_a=0.0,
                                                             max_len_b=limit, length_norm=norm))
        ended += sum(len(o) < limit for o in outs["length"][-len(chunk):])
    return {"beam vs greedy": sum(a == b for a, b in zip(outs["zero"], outs["greedy"],
                                                        strict=True)),
            "gnmt vs length": sum(a == b for a, b in zip(outs["gnmt"], outs["length"],
                                                        strict=True)),
            "ended": ended}


def test_a_run_reports_the_engines_agreeing_and_our_own_counts(toy_workspace,
                                                               inputs, tmp_path, capsys):
    """Exact engine settings agree 8/8, log P to 1e-3; our own counts match a separate decode."""
    # (the first 8 non-empty lines of 10; a separate decode as the docstring batches it)
    model = tiny_model(toy_workspace, seed=0, eos_scale=3.0)
    folder = save_folder(model, toy_workspace, tmp_path / "model")
    report = agreement.main(["--model", str(folder), "--inputs", str(inputs), "--lines", "8",
                             "--batch-size", "3", "--beam", "2", "--alpha", "0.6",
                             "--max-len-b", "3", "--threads", "1"])
    tok = load_tokenizer(toy_workspace / "data/vocab/tokenizer.json")
    texts = [t.strip() for t in inputs.read_text(encoding="utf-8").splitlines()]
    ids = [s[:39] for s in encode_ids(tok, texts) if s][:8]
    assert len(ids) == 8 and len(texts) == 12  # 10 non-empty lines, the first 8 taken
    exact = ["greedy ctranslate2", "greedy transformers", "beam 2 alpha 0 ctranslate2",
             "beam 2 alpha 0 transformers", "beam 2 alpha 0.6 (|Y|^a) transformers",
             "beam 2 alpha 0.6 (|Y|^a) ctranslate2, patience 1000"]
    for key in exact:
        assert report[key] == "8/8 identical", key
    assert report["beam 2 alpha 0.6 (|Y|^a) ctranslate2, patience 1"].endswith("/8 identical")
    ours = documented_counts(model, ids, batch_size=3, beam=2, alpha=0.6, max_len_b=3)
    assert 0 < ours["ended"] < 8  # outputs that end and outputs cut at the limit: both kinds
    assert report["beam 2 vs greedy (aiayn)"] == f"{ours['beam vs greedy']}/8 identical"
    assert report["beam 2 alpha 0.6 aiayn GNMT vs |Y|^a"] == (
        f"{ours['gnmt vs length']}/8 identical")
    for key in ("max |log P| difference, ctranslate2 score_batch",
                "max |log P| difference, transformers forward",
                "max |ctranslate2 beam score x |Y|^a - our log P|"):
        assert float(report[key]) < 1e-3, key
    assert len(report) == len(exact) + 6
    printed = capsys.readouterr().out
    assert f"8 sentences of {inputs}" in printed
    for key, value in report.items():  # one aligned line each
        assert re.search(rf"^  {re.escape(key)} +{re.escape(value)}$", printed, re.M), key


def test_a_model_whose_outputs_all_run_to_the_limit_still_gets_its_report(toy_workspace, inputs,
                                                                           tmp_path):
    """A model whose beam outputs all run to the length limit (none ends with EOS) still gets
    its report; the ctranslate2 score comparison, which needs outputs that end, says that
    none was compared instead of a number."""
    model = tiny_model(toy_workspace, seed=3)
    folder = save_folder(model, toy_workspace, tmp_path / "model")
    report = agreement.main(["--model", str(folder), "--inputs", str(inputs), "--lines", "3",
                             "--beam", "2", "--max-len-b", "2", "--threads", "1"])
    assert report["greedy ctranslate2"] == "3/3 identical"
    assert (report["max |log P| difference, ctranslate2 score_batch"]
            == "none compared (no output ended before its limit)")
    assert float(report["max |log P| difference, transformers forward"]) < 1e-3
