"""bench/same_learning.py: the two `aiayn train` runs it makes on the toy shards (params that
differ in the varied setting only, curves read back from their logs), and its errors."""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import pytest
import yaml

from bench import same_learning as same

# A model and batch budget the size of the toy shards (the demo preset's are 4x larger).
TINY = ["model.d_model=32", "model.heads=4", "model.encoder_layers=1",
        "model.decoder_layers=1", "model.d_ff=64", "train.tokens_per_step=320",
        "train.warmup_steps=2"]


def read_log(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def test_read_tsv_gives_floats_and_nan_for_an_empty_cell(tmp_path):
    """Every cell of a log becomes a float, an empty BLEU cell NaN, as the csv module reads."""
    path = tmp_path / "valid_log.tsv"
    path.write_text("step\tvalid_loss\tvalid_nll\tvalid_ppl\ttokens\tvalid_bleu\n"
                    "2\t5.93749\t5.6358\t280.284\t966\t\n"
                    "4\t5.40038\t5.19728\t180.779\t966\t12.5\n")
    rows = same.read_tsv(path)
    expected = read_log(path)
    assert [list(r) for r in rows] == [list(e) for e in expected]
    for row, want in zip(rows, expected, strict=True):
        for key, text in want.items():
            assert isinstance(row[key], float)
            if text:
                assert row[key] == float(text)
            else:
                assert math.isnan(row[key])


@pytest.mark.parametrize("vary", ["kernels=plain,fast", "data.vocab_size=4000,8000",
                                  "train.=a,b", "train.kernels=fast",
                                  "train.kernels=plain,fast,fast"])
def test_a_malformed_vary_stops_before_any_data_is_made(tmp_path, vary):
    """--vary not of the form model.KEY=A,B or train.KEY=A,B is an error naming both forms."""
    work = tmp_path / "work"
    with pytest.raises(SystemExit) as stop:
        same.main(["--preset", "demo", "--workdir", str(work), "--vary", vary])
    assert f"--vary {vary!r}" in str(stop.value)
    assert "expected model.KEY=A,B or train.KEY=A,B" in str(stop.value)
    assert not work.exists()


def test_a_failing_command_stops_with_its_stderr_and_without_mlflow(monkeypatch):
    """A failed command stops with its name and stderr's tail; children never see MLflow's URI."""
    # (a benchmark run must not log to the user's tracking server)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    same.subprocess_run([sys.executable, "-c",
                         "import os, sys; sys.exit('MLFLOW_TRACKING_URI' in os.environ)"])
    with pytest.raises(SystemExit) as stop:
        same.subprocess_run([sys.executable, "-c",
                             "import sys; sys.stderr.write('x' * 5000 + 'the cause'); "
                             "sys.exit(4)"])
    message = str(stop.value)
    assert message.startswith(f"error: {sys.executable} -c failed:")
    assert message.endswith("the cause")
    assert len(message) < 3100  # the tail only


def test_the_same_value_twice_stops_before_any_data_is_made(tmp_path):
    """--vary with two equal values (nothing to compare, and one run folder for both) is an
    error saying to give two different ones."""
    work = tmp_path / "work"
    with pytest.raises(SystemExit, match="the two values are the same; give two different"):
        same.main(["--preset", "demo", "--workdir", str(work), "--vary", "train.kernels=fast,fast"])
    assert not work.exists()


def test_two_toy_runs_differ_in_the_varied_setting_and_their_curves_are_compared(toy_workspace,
                                                                                 tmp_path, capsys):
    """Runs differ only in train.kernels; rows are their valid logs and differences from them."""
    work, out = tmp_path / "work", tmp_path / "same.json"
    result = same.main(["--preset", "demo", *(a for o in TINY for a in ("-S", o)),
                        "--shards", str(toy_workspace / "data/shards"),
                        "--tokenizer", str(toy_workspace / "data/vocab/tokenizer.json"),
                        "--workdir", str(work), "--steps", "4", "--valid-every", "2",
                        "--json", str(out)])
    (folder,) = work.glob("same-learning-*")
    params = {v: yaml.safe_load((folder / v / "params.yaml").read_text())
              for v in ("plain", "fast")}
    assert params["plain"]["train"].pop("kernels") == "plain"
    assert params["fast"]["train"].pop("kernels") == "fast"
    assert params["plain"] == params["fast"]  # nothing else differs
    train, model = params["plain"]["train"], params["plain"]["model"]
    assert (train["steps"], train["valid_every"], train["valid_bleu_every"]) == (4, 2, 0)
    assert (train["checkpoint_every_steps"], train["log_every"]) == (4, 4)
    assert (model["d_model"], model["d_ff"], train["tokens_per_step"]) == (32, 64, 320)
    for value in ("plain", "fast"):
        summary = json.loads((folder / value / "train.json").read_text())
        assert summary["kernels"] == value and summary["steps"] == 4  # what the run did
        assert result["runs"][value]["summary"] == summary
    plain, fast = (read_log(folder / v / "valid_log.tsv") for v in ("plain", "fast"))
    rows = result["rows"]
    assert [r["step"] for r in rows] == [2, 4]
    for row, a, b in zip(rows, plain, fast, strict=True):
        assert int(a["step"]) == row["step"]
        assert int(b["step"]) == row["step"]
        la, lb = float(a["valid_loss"]), float(b["valid_loss"])
        na, nb = float(a["valid_nll"]), float(b["valid_nll"])
        assert (row["plain"], row["fast"]) == pytest.approx((la, lb), rel=1e-12)
        assert (row["nll plain"], row["nll fast"]) == pytest.approx((na, nb), rel=1e-12)
        assert row["relative"] == pytest.approx((lb - la) / la)
        assert row["relative_nll"] == pytest.approx((nb - na) / na)
    final = rows[-1]["relative"]
    verdict = "within" if abs(final) < 0.005 else "NOT within"
    assert f"final valid loss: {verdict} 0.5% ({final:+.2%})" in capsys.readouterr().out
    text = out.read_text()
    saved = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))
    assert saved["rows"] == rows
    # the valid logs' empty BLEU cells (valid_bleu_every 0) are NaN in memory, null on disk
    logged = result["runs"]["plain"]["valid"][0]
    blank = [k for k, v in logged.items() if v != v]
    assert blank and all(saved["runs"]["plain"]["valid"][0][k] is None for k in blank)
    assert (saved["vary"], saved["steps"], saved["overrides"]) == (
        "train.kernels=plain,fast", 4, TINY)
