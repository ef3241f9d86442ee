"""bench/decode_speed.py: its batches against aiayn.decoding.translation's own batching, its summary
and agreement counts against hand-computed ones, and a short run of a tiny exported model with
references, whose results are checked field by field (sizes far below the benchmark's; no
timing is asserted). Whether the engines decode as ours does is
tests/test_bench_export_agreement.py's."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from aiayn.decoding.beam import BeamConfig
from aiayn.decoding.translation import BatchTranslator, source_batch
from aiayn.model import Transformer, TransformerConfig
from bench import decode_speed as ds
from tests.conftest import (
    SENTENCES_DE,
    SENTENCES_EN,
    save_model_folder,
    usage_error,
)


@pytest.fixture
def keep_threads():
    """main() sets torch's thread count; the test process gets its own back."""
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def tokenizer():
    from aiayn.data.tokenizer import train_bpe

    return train_bpe(SENTENCES_EN + SENTENCES_DE, vocab_size=400, min_frequency=1)


def tiny_model(vocab: int, seed: int = 0, **changes) -> Transformer:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=vocab, d_model=16, heads=2, encoder_layers=1, decoder_layers=1,
               d_ff=32, dropout=0.1, max_positions=40)
    return Transformer(TransformerConfig(**{**cfg, **changes})).eval()


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    """A tiny untrained model exported as `aiayn average` exports one (as test_translate)."""
    from aiayn.data.tokenizer import save_tokenizer

    root = tmp_path_factory.mktemp("decode_speed")
    tok_path = root / "tokenizer.json"
    save_tokenizer(tokenizer, tok_path)
    model = tiny_model(tokenizer.get_vocab_size(), seed=3, d_model=32, heads=4, d_ff=64)
    out = root / "model"
    return save_model_folder(model, tok_path, out)


# Source lines for --inputs: blank lines, a line over the tiny model's 39-token limit, mixed
# lengths (so that sorting by length changes the order).
LINES = [SENTENCES_EN[1], "", SENTENCES_EN[0], "   ", SENTENCES_DE[4], "Hello", SENTENCES_EN[2],
         " ".join(SENTENCES_EN[1:4]), SENTENCES_DE[0], SENTENCES_EN[5], "", SENTENCES_DE[2],
         "Das Haus.", SENTENCES_EN[4]]


# --------------------------------------------------------------------------- batches


class SpyTranslator(BatchTranslator):
    """aiayn.decoding.translation's line handling (strip, drop empty, truncate, sort, batch) with a
    decoder that records the batches it is given."""

    def __init__(self, tokenizer, max_positions: int):
        self.tokenizer = tokenizer
        self.limit = max_positions - 1
        self.batches: list[list[list[int]]] = []

    @property
    def max_source_tokens(self) -> int:
        return self.limit

    def decode_batch(self, sources, cfg):
        self.batches.append(sources)
        return [[] for _ in sources]


def test_inputs_are_the_batches_aiayn_translate_makes(tokenizer, tmp_path):
    """read_inputs + cut_batches against the batches aiayn.decoding.translation makes for the
    same lines."""
    # The batches `aiayn translate --truncate` makes for the file's first batches x batch-size
    # non-empty lines, each source + EOS, PAD-padded, with max length = source + EOS + b capped
    # by the model's limit. The texts are those lines (stripped); the stats count lines, blanks
    # and cut lines.
    path = tmp_path / "in.txt"
    path.write_text("".join(line + "\n" for line in LINES), encoding="utf-8")
    limit, n_batches, size = 12, 2, 3
    n = n_batches * size
    pool, texts, stats, chosen = ds.read_inputs(path, tokenizer, n, limit)
    nonblank = [i for i, line in enumerate(LINES) if line.strip()]
    spy = SpyTranslator(tokenizer, limit)
    spy.translate(LINES[:nonblank[n - 1] + 1], BeamConfig(), batch_size=size, truncate=True)
    expected = spy.batches[:n_batches]
    cfg = BeamConfig(max_len_a=1.0, max_len_b=5)
    batches = ds.cut_batches(pool, size, cfg, limit, texts)
    assert [b.words for b in batches] == expected
    for b in batches:
        assert torch.equal(b.src, source_batch(b.words))
        assert b.max_len == [min(limit, len(w) + 1 + 5) for w in b.words]
        assert b.ct2_max_len == max(b.max_len)
    assert any(len(w) + 1 + 5 > limit for b in batches for w in b.words)  # the cap is met
    assert [t for b in batches for t in b.texts] == [LINES[i].strip() for i in chosen]
    lengths = {i: len(tokenizer.encode(line.strip(), add_special_tokens=False).ids)
               for i, line in enumerate(LINES)}
    assert [len(w) for w in pool] == [min(lengths[i], limit - 1) for i in chosen]
    assert stats == {
        "file": str(path), "lines": len(LINES), "empty_dropped": len(LINES) - len(nonblank),
        "selected": n,
        "truncated_in_file": sum(k > limit - 1 for k in lengths.values()),
        "mean_src_tokens": pytest.approx(statistics.fmean(len(w) for w in pool)),
        "min_src_tokens": min(len(w) for w in pool), "max_src_tokens": max(len(w) for w in pool)}
    assert stats["truncated_in_file"] > 0


# --------------------------------------------------------------------------- agreement


def test_agreement_counts_identical_outputs_between_the_methods_that_ran():
    """agreement and timed_agreement against counts made by hand: each pair of methods that
    both ran, over every batch (recompute: its own batches only)."""
    assert ds.agreement([[1], [2, 3], []], [[1], [2], []]) == {
        "sentences": 3, "identical": 2, "rate": pytest.approx(2 / 3)}
    assert ds.agreement([], [])["rate"] == 1.0
    fo = {"cached": {0: [[1], [2]], 1: [[3], [4, 5]]},
          "ct2": {0: [[1], [2]], 1: [[3], [4]]},
          "ct2_int8": {0: [[1], [9]], 1: [[3], [4]]},
          "recompute": {1: [[3], [4, 5]]}}
    agree = ds.timed_agreement(fo, 2, [1])
    assert {k: v["identical"] for k, v in agree.items()} == {
        "cached vs ct2": 3, "cached vs ct2_int8": 2, "cached vs recompute": 2,
        "ct2 vs ct2_int8": 3}
    assert agree["cached vs recompute"]["sentences"] == 2


# --------------------------------------------------------------------------- summary


def test_profile_shows_where_one_cached_search_spends_its_time(capsys):
    """--profile: cProfile's functions, then torch.profiler's operators, of one cached search."""
    model = tiny_model(60)
    cfg = BeamConfig(beam=2, max_len_a=1.0, max_len_b=3)
    batch = ds.cut_batches([[5, 6, 7], [8, 9, 10, 11]], 2, cfg, 40)[0]
    out = ds.profile_cached(model, batch, cfg)
    printed = capsys.readouterr().out
    assert printed.index("-- cProfile, cached beam search") < printed.index(
        "-- torch.profiler, same batch")
    assert "function calls" in printed and "aten::" in out["profiler_table"]


def test_summary_takes_medians_and_ratios_of_the_same_rounds():
    """summarize against medians and per-round ratios computed by hand (not ratios of medians)."""
    # Figures are medians over rounds; a speed ratio is the median over rounds of that round's time
    # ratio on the same batches (recompute's batches for cached / recompute), not a ratio of
    # medians; ratios of methods that did not run are left out.
    # (wall, cpu, sentences, tokens) per batch index, per round
    cached = [{0: (1.0, 2.0, 4, 30), 1: (2.0, 4.0, 4, 50)},
              {0: (1.0, 1.0, 4, 30), 1: (5.0, 5.0, 4, 50)},
              {0: (2.0, 3.0, 4, 30), 1: (2.0, 2.0, 4, 50)}]
    recompute = [{1: (10.0, 10.0, 4, 50)}, {1: (12.0, 12.0, 4, 50)}, {1: (8.0, 8.0, 4, 50)}]
    ct2 = [{0: (1.0, 1.0, 4, 31), 1: (1.0, 1.0, 4, 52)},
           {0: (1.0, 1.0, 4, 31), 1: (1.0, 1.0, 4, 52)},
           {0: (4.0, 4.0, 4, 31), 1: (4.0, 4.0, 4, 52)}]
    out = ds.summarize({"cached": cached, "recompute": recompute, "ct2": ct2}, [1], 3)
    c = out["cached"]
    assert c["walls"] == [3.0, 6.0, 4.0]
    assert c["wall_s"] == 4.0 and c["cpu_s"] == 6.0
    assert (c["sentences"], c["tokens"]) == (8, 80)
    assert c["sent_per_s"] == pytest.approx(2.0)  # median of 8/3, 8/6, 8/4
    assert c["tok_per_s"] == pytest.approx(20.0)
    assert c["cpu_per_wall"] == pytest.approx(1.25)  # median of 6/3, 6/6, 5/4
    assert out["recompute"]["sentences"] == 4
    # per round recompute / cached on batch 1: 5, 2.4, 4 -> 4 (a ratio of medians: 10 / 2)
    assert out["ratios"]["cached / recompute"] == pytest.approx(4.0)
    # per round ct2 / cached: 2/3, 2/6, 8/4 -> 2/3 (of medians: 1/2); cached / ct2: 1.5, 3,
    # 0.5 -> 1.5 (of medians: 2)
    assert out["ratios"]["ours cached / ct2"] == pytest.approx(2 / 3)
    assert out["ratios"]["ct2 fp32 / ours cached"] == pytest.approx(1.5)
    assert set(out["ratios"]) == {"cached / recompute", "ours cached / ct2",
                                  "ct2 fp32 / ours cached"}


# --------------------------------------------------------------------------- main


@pytest.mark.parametrize("argv, message", [
    ([], "the following arguments are required: --model, --inputs"),
    (["--model", "no-such-folder"], "--model no-such-folder: not a folder"),
    (["--rounds", "0"], "--rounds (0) must be at least 1"),
    (["--batches", "0"], "--batches (0) must be at least 1"),
    (["--threads", "1,"], "--threads '1,': give thread counts separated by commas, e.g. 1,2"),
    (["--threads", "0"], "--threads '0': each thread count must be at least 1"),
])
def test_bad_arguments_stop_with_the_fix(argv, message, capsys):
    """A missing model or inputs, or a value out of range: argparse's exit 2 and the fix."""
    given = [] if not argv else ["--model", ".", "--inputs", "in.txt", *argv]
    assert message in usage_error(lambda: ds.main(given), capsys)


@pytest.mark.parametrize("case, message", [
    ("references", "has 3 lines, --inputs 14"),
    ("blank", "has no non-empty line"),
    ("missing", "no such file"),
])
def test_unusable_inputs_or_references_stop_with_a_message(model_dir, tmp_path, case,
                                                           message, keep_threads):
    """Unusable --inputs/--references: the run stops before decoding with a message."""
    # --references of another length, an --inputs of blank lines only, or a missing one: the run
    # stops before decoding, naming the file.
    inputs, refs = tmp_path / "in.txt", tmp_path / "refs.txt"
    inputs.write_text("\n".join(LINES) + "\n" if case != "blank" else "\n  \n\n")
    refs.write_text("a\nb\nc\n")
    argv = ["--model", str(model_dir), "--inputs", str(inputs if case != "missing"
                                                      else tmp_path / "none.txt"),
            "--no-ct2", "--no-hf", "--threads", "1"]
    if case == "references":
        argv += ["--references", str(refs)]
    with pytest.raises(SystemExit) as stop:
        ds.main(argv)
    assert message in str(stop.value.code)


def test_a_run_reports_every_method_and_scores_each_engine_against_the_references(
        model_dir, tokenizer, tmp_path, keep_threads):
    """A tiny exported-model run: the JSON field by field, every method's figures and agreement,
    and ours' BLEU equal to sacreBLEU of aiayn's Translator on the lines."""
    # --model/--inputs/--references on a tiny exported model: the inputs' stats; every method
    # decoded every sentence (recompute: the middle batch) in each round, cached and recompute
    # alike; BLEU of every method but recompute on the selected lines, where ours equals
    # sacreBLEU of what aiayn.decoding.translation's Translator outputs for the same lines
    # against their references (line for line: a misaligned reference would change it); the
    # examples show the sources with the Translator's outputs.
    import sacrebleu

    from aiayn.decoding.translation import load_translator

    inputs, refs = tmp_path / "in.txt", tmp_path / "refs.txt"
    inputs.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    nonblank = [i for i, line in enumerate(LINES) if line.strip()]
    chosen = nonblank[:8]  # the first 2 x 4
    cfg = BeamConfig(beam=4, alpha=0.6, max_len_a=1.0, max_len_b=4)
    ours = load_translator(model_dir, device="cpu").translate(
        [LINES[i] for i in chosen], cfg, truncate=True)
    by_line = dict(zip(chosen, ours, strict=True))
    # half the references are our output itself, the others another sentence
    ref_lines = [by_line[i] if k % 2 == 0 else "The house is small." for k, i in
                 enumerate(chosen)]
    all_refs = ["unused reference"] * len(LINES)
    for i, r in zip(chosen, ref_lines, strict=True):
        all_refs[i] = r
    refs.write_text("\n".join(all_refs) + "\n", encoding="utf-8")
    out = tmp_path / "real.json"
    argv = ["--model", str(model_dir), "--inputs", str(inputs), "--references", str(refs),
            "--batches", "2", "--batch-size", "4", "--rounds", "2", "--threads", "1",
            "--max-len-b", "4", "--no-bf16", "--examples", "3", "--json", str(out)]
    info = ds.main(argv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(info, default=str))
    # the arguments main was given, not pytest's
    assert info["command"].endswith("-m bench.decode_speed " + " ".join(argv))
    assert info["model"]["dir"] == str(model_dir)
    assert info["beam"]["beam"] == 4 and info["beam"]["alpha"] == 0.6
    assert info["threads"] == [1] and info["rounds"] == 2
    lengths = [n for b in info["batches"] for n in b["words"]]
    assert lengths == sorted(lengths)
    for b in info["batches"]:
        assert b["shape"] == [4, b["words"][1] + 1]  # the longest source + EOS
        assert b["ct2_max_len"] == min(40, b["words"][1] + 1 + 4)
    assert info["recompute_batches"] == [1]
    res = info["results"]["1"]
    methods = {"cached", "recompute", "ct2", "ct2_int8", "hf"}
    assert set(res) == methods | {"ratios"} and set(info["timed_outputs"]) == methods
    for m in methods:
        n = 4 if m == "recompute" else 8
        timed = info["timed_outputs"][m]
        assert res[m]["sentences"] == n and timed["sentences"] == n
        assert res[m]["tokens"] == timed["tokens"] >= n  # every output counts its EOS
        assert len(res[m]["walls"]) == 2 and res[m]["wall_s"] > 0
    assert set(res["ratios"]) == {"cached / recompute", "ours cached / ct2",
                                  "ct2 fp32 / ours cached", "ct2 int8 / ours cached",
                                  "ct2 int8 / ct2 fp32", "transformers / ours cached"}
    assert info["agreement"]["cached vs recompute"] == {"sentences": 4, "identical": 4,
                                                        "rate": 1.0}
    assert info["agreement"]["cached vs ct2"]["sentences"] == 8
    assert info["inputs"]["lines"] == len(LINES) and info["inputs"]["selected"] == 8
    assert info["inputs"]["empty_dropped"] == len(LINES) - len(nonblank)
    assert info["references"] == str(refs)
    bleu = info["bleu"]
    assert bleu["sentences"] == 8
    assert set(bleu["scores"]) == {"cached", "ct2", "ct2_int8", "hf"}  # not recompute
    expected = sacrebleu.corpus_bleu(ours, [ref_lines]).score
    assert bleu["scores"]["cached"] == pytest.approx(expected)
    # the half-and-half references make it a telling number, neither 0 nor 100
    assert expected > 0
    assert expected < 100
    assert "nrefs:1" in bleu["signature"] and "tok:13a" in bleu["signature"]
    examples = info["examples"]
    assert len(examples) == 3
    selected = {LINES[i].strip(): by_line[i] for i in chosen}
    for ex in examples:
        assert ex["ours"] == selected[ex["source"]]
        assert ex["src_tokens"] == min(
            39, len(tokenizer.encode(ex["source"], add_special_tokens=False).ids))
        for m in ("ct2", "ct2_int8", "hf"):
            assert isinstance(ex[f"{m}_same_tokens"], bool)
    # spread over the length range: the shortest and the longest selected sentence
    assert examples[0]["src_tokens"] == info["inputs"]["min_src_tokens"]
    assert examples[-1]["src_tokens"] == info["inputs"]["max_src_tokens"]
    assert set(info["agreement"]) == {"cached vs ct2", "cached vs ct2_int8", "cached vs hf",
                                      "cached vs recompute", "ct2 vs ct2_int8"}
