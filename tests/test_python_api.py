"""docs/python-api.md runs as written, and does what it says.

Every ```python block of the page runs in a fresh namespace (each must stand alone, as the
page says), in the page's order, in one temporary folder: section 2 writes ``toy/``, sections
3 and 4 read it. What the blocks print and leave behind is checked against expectations
computed here, not by the page: the parameter count against the formula of the model's
dimensions, a falling training loss, the averaged weights against the checkpoints and the
model folder against `aiayn average`'s, the translations against `aiayn translate`'s (a
checkpoint's against its model built here), BLEU against sacreBLEU called directly, and the
exported models' outputs against our own decoder's.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO

DOC = REPO / "docs/python-api.md"
WORK = "toy"  # the folder section 2 writes, relative to where the blocks run
SENTENCES = ["The small dog sees the cat.", "A man reads a book because it rains."]


def blocks_by_section(text: str) -> dict[int, list[str]]:
    """The ```python blocks under each numbered ``## N.`` heading, in order."""
    sections: dict[int, list[str]] = {}
    section, block = None, None
    for line in text.splitlines():
        if block is not None:
            if line.strip() == "```":
                sections.setdefault(section, []).append("\n".join(block) + "\n")
                block = None
            else:
                block.append(line)
        elif m := re.match(r"## (\d+)\. ", line):
            section = int(m.group(1))
        elif line.strip() == "```python":
            assert section is not None, "a python block before the first numbered section"
            block = []
    assert block is None, "an unclosed ```python block"
    return sections


BLOCKS = blocks_by_section(DOC.read_text(encoding="utf-8"))


@contextlib.contextmanager
def inside(folder: Path) -> Iterator[None]:
    """Run in ``folder``, on one thread (the page's matrices are tiny: more threads only
    wait for each other, and the suite shares its cores), offline."""
    old_cwd, old_threads = Path.cwd(), torch.get_num_threads()
    old_offline = os.environ.get("HF_HUB_OFFLINE")
    os.chdir(folder)
    torch.set_num_threads(1)
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        os.chdir(old_cwd)
        torch.set_num_threads(old_threads)
        if old_offline is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old_offline


def run_section(number: int, folder: Path) -> list[tuple[dict, list[str]]]:
    """Run section ``number``'s blocks in ``folder``: each block's namespace and printed
    lines."""
    assert BLOCKS.get(number), f"{DOC.name} has no python block in section {number}"
    results = []
    with inside(folder):
        for i, code in enumerate(BLOCKS[number], 1):
            namespace: dict = {"__name__": "__main__"}
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(code, f"{DOC.name}, section {number}, block {i}", "exec"),
                     namespace)
            results.append((namespace, out.getvalue().splitlines()))
    return results


def printed_list(line: str) -> list:
    """A printed Python list (``print(translator.translate(...))``) read back."""
    value = ast.literal_eval(line)
    assert isinstance(value, list), line
    return value


def parameters_by_formula(vocab: int, d: int, d_ff: int, enc: int, dec: int) -> int:
    """Section 3 of the paper counted by hand: one shared embedding matrix (no separate
    output projection, sinusoids are no parameters); per encoder layer self-attention's
    four d x d projections with biases, the FFN, two LayerNorms; per decoder layer two
    attentions and three LayerNorms."""
    attention = 4 * d * d + 4 * d
    ffn = 2 * d * d_ff + d_ff + d
    norm = 2 * d
    return vocab * d + enc * (attention + ffn + 2 * norm) + dec * (2 * attention + ffn + 3 * norm)


def test_the_page_has_its_sections_and_links():
    assert sorted(BLOCKS) == [1, 2, 3, 4]
    text = DOC.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#]+\.md)(?:#[^)]*)?\)", text):
        assert (DOC.parent / target).is_file(), f"{DOC.name} links to a missing {target}"


def test_section_1_builds_the_papers_model_and_counts_its_parameters(tmp_path):
    from aiayn.model import count_parameters

    [(ns, printed)] = run_section(1, tmp_path)
    cfg, model = ns["cfg"], ns["model"]
    assert (cfg.d_model, cfg.heads, cfg.encoder_layers, cfg.decoder_layers, cfg.d_ff,
            cfg.dropout, cfg.vocab_size) == (512, 8, 6, 6, 2048, 0.1, 37_000)
    expected = parameters_by_formula(37_000, 512, 2048, 6, 6)
    assert expected == 63_082_496  # the figure the page prints in its comment
    assert count_parameters(model) == expected
    assert printed[0] == f"{expected:,} parameters"
    assert ns["logits"].shape == (2, 4, 37_000) and printed[1] == "torch.Size([2, 4, 37000])"
    assert torch.isfinite(ns["logits"]).all()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, list[tuple[dict, list[str]]]]:
    """The folder where section 2 ran, and its blocks' namespaces and output."""
    folder = tmp_path_factory.mktemp("python-api")
    return folder, run_section(2, folder)


def test_section_2_trains_through_the_library_and_the_loss_falls(trained):
    from safetensors.torch import load_file

    from aiayn.config import load_params
    from aiayn.training.checkpoint import list_checkpoints, load_checkpoint

    folder, [(train_ns, printed), (average_ns, listed)] = trained
    p, summary, trainer = train_ns["p"], train_ns["summary"], train_ns["trainer"]
    work = folder / WORK
    assert load_params(work / "params.yaml") == p  # the later sections read it back
    assert summary["steps"] == p.train.steps and summary["stopped_by"] == "steps"
    losses = [row.loss for row in trainer.log.train]
    assert len(losses) == p.train.steps // p.train.log_every
    assert printed[0] == str([round(x, 2) for x in losses])
    assert losses[-1] < losses[0] - 0.5, losses
    assert summary["valid_loss"] < losses[0]
    for name in ("train.json", "train_log.tsv", "valid_log.tsv"):
        assert (work / name).is_file(), name
    steps = [int(path.stem.removeprefix("step-")) for path in list_checkpoints(
        work / "checkpoints")]
    assert steps == [50, 100]
    # The model folder holds the mean of the last two checkpoints, as `aiayn average` would.
    assert listed == ["[50, 100] ['config.json', 'model.safetensors', 'tokenizer.json']"]
    saved = load_file(work / "model/model.safetensors")
    a, b = (load_checkpoint(work / f"checkpoints/step-{s:08d}.pt")["model"] for s in steps)
    assert saved.keys() == a.keys()
    for name, tensor in saved.items():
        torch.testing.assert_close(tensor, (a[name] + b[name]) / 2, rtol=0, atol=1e-6)
    assert average_ns["config"] == json.loads((work / "model/config.json").read_text())
    assert (work / "model/tokenizer.json").read_bytes() == (work / "tokenizer.json").read_bytes()


def test_section_2_writes_the_model_folder_the_average_command_writes(trained):
    from typer.testing import CliRunner

    from stages.cli import app

    folder, _ = trained
    with inside(folder):
        result = CliRunner().invoke(app, [
            "average", "--params", f"{WORK}/params.yaml", "--checkpoints",
            f"{WORK}/checkpoints", "--tokenizer", f"{WORK}/tokenizer.json", "--out",
            "cli-model", "--metrics", "average.json", "--no-mlflow", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (folder / "cli-model" / name).read_bytes() == (
            folder / WORK / "model" / name).read_bytes(), name


def test_section_3_translates_as_the_translate_command_and_scores_as_sacrebleu(trained):
    import pyarrow.parquet as pq
    import sacrebleu
    from typer.testing import CliRunner

    from aiayn.decoding.beam import BeamConfig
    from stages.cli import app

    folder, _ = trained
    [(ns, printed), (ckpt_ns, ckpt_printed)] = run_section(3, folder)
    assert ns["sentences"] == SENTENCES
    # the decode.* settings, as `aiayn translate` reads them: the paper's Section 6.1
    assert ns["beam"] == BeamConfig(beam=4, alpha=0.6, max_len_a=1.0, max_len_b=50,
                                    length_norm="gnmt")
    ours = printed_list(printed[0])
    test = pq.read_table(folder / WORK / "raw/test.parquet").to_pydict()
    assert ns["sources"] == test["en"] and ns["references"] == test["de"]
    hypotheses = ns["hypotheses"]
    assert len(hypotheses) == len(test["en"]) == 50
    assert any(hypotheses), "every translation is empty: the comparisons below prove little"

    base = ["translate", "--params", f"{WORK}/params.yaml", "--model", f"{WORK}/model",
            "--no-progress", "--device", "cpu"]
    with inside(folder):
        given = CliRunner().invoke(app, [*base, *SENTENCES])
        split = CliRunner().invoke(app, [*base, "--split", "test", "--raw", f"{WORK}/raw",
                                         "--out", "test.de"])
    assert given.exit_code == 0, given.output
    assert given.stdout.splitlines() == ours
    assert split.exit_code == 0, split.output
    assert (folder / "test.de").read_text(encoding="utf-8").splitlines() == hypotheses

    scores = ns["scores"]
    bleu = sacrebleu.corpus_bleu(hypotheses, [test["de"]])
    assert scores["bleu"]["score"] == pytest.approx(bleu.score)
    assert scores["bleu"]["sys_len"] == bleu.sys_len and scores["bleu"]["ref_len"] == bleu.ref_len
    assert printed[1].startswith(f"sacreBLEU {bleu.score:.2f} (nrefs:1|")

    # The checkpoint's translator decodes the last checkpoint's weights, as that model
    # built by hand does.
    from aiayn.data.tokenizer import load_tokenizer
    from aiayn.decoding.translation import Translator
    from aiayn.model import Transformer, TransformerConfig
    from aiayn.training.checkpoint import load_checkpoint

    last = load_checkpoint(folder / WORK / "checkpoints/step-00000100.pt")
    state = ckpt_ns["translator"].model.state_dict()
    assert state.keys() == last["model"].keys()
    assert all(torch.equal(state[name], tensor) for name, tensor in last["model"].items())
    model = Transformer(TransformerConfig(**last["meta"]["model_config"]))
    model.load_state_dict(last["model"])
    by_hand = Translator(model.eval(), load_tokenizer(folder / WORK / "tokenizer.json"),
                         torch.device("cpu"))
    assert printed_list(ckpt_printed[0]) == by_hand.translate(SENTENCES[:1], BeamConfig())


@pytest.fixture
def export_extras() -> None:
    """The `[export]` extra's packages, or a skip (before section 2 runs for nothing)."""
    pytest.importorskip("ctranslate2")
    pytest.importorskip("transformers")


def test_section_4_exports_translate_as_our_decoder_does(export_extras, trained):
    from aiayn.decoding.beam import BeamConfig
    from aiayn.decoding.translation import load_translator

    folder, _ = trained
    work = folder / WORK
    [(ns, printed), (hf_ns, hf_printed)] = run_section(4, folder)
    assert {"model.bin", "shared_vocabulary.json", "aiayn.json"} <= {
        f.name for f in (work / "export/ctranslate2").iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "aiayn.json"} <= {
        f.name for f in (work / "export/transformers").iterdir()}
    sentences, outputs = ns["sentences"], ns["outputs"]
    assert sentences[:2] == SENTENCES and len(sentences) == 3
    ours = load_translator(work / "model", device="cpu").translate(
        sentences, BeamConfig(beam=1, max_len_a=0, max_len_b=20))
    assert any(ours), "every translation is empty: the comparison proves little"
    assert outputs == {"aiayn": ours, "ctranslate2": ours, "transformers": ours}
    assert len(printed) == 2 + 3
    # transformers on its own, with the folder's tokenizer: the same greedy outputs
    assert printed_list(hf_printed[0]) == ours[:2]
