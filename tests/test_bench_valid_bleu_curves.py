"""bench/valid_bleu_curves.py: training logs in the layout the train stage writes, the
steps-to-minutes interpolation, the printed last/best BLEU and the data of the drawn curves."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.figure
import pytest

from bench import valid_bleu_curves as curves


def metrics_folder(root: Path, train: list[tuple[int, float, float]],
                   bleu: list[tuple[int, float | None]]) -> Path:
    """A metrics folder: train_log.tsv rows (step, lr, elapsed_s) with the trainer's other
    columns, valid_bleu.tsv rows (step, BLEU), an empty cell where BLEU is None."""
    root.mkdir(parents=True)
    head = "step\tloss\tnll\tlr\tgrad_norm\ttokens\ttokens_per_s\telapsed_s\n"
    (root / "train_log.tsv").write_text(head + "".join(
        f"{s}\t5.0\t4.5\t{lr}\t1.0\t900\t100.0\t{e}\n" for s, lr, e in train))
    (root / "valid_bleu.tsv").write_text("step\tvalid_bleu\n" + "".join(
        f"{s}\t{'' if b is None else b}\n" for s, b in bleu))
    return root


# Run "fast": elapsed 60, 120, 240, 300 s at steps 10..40, so step 15 is at 1.5 min (halfway
# between 1 and 2), step 30 at 4 and step 40 at 5. Its step-20 BLEU cell is empty.
FAST_TRAIN = [(10, 1e-3, 60.0), (20, 2e-3, 120.0), (30, 1.5e-3, 240.0), (40, 1e-3, 300.0)]
FAST_BLEU = [(15, 5.0), (20, None), (30, 12.5), (40, 11.0)]
SLOW_TRAIN = [(20, 4e-4, 600.0), (40, 8e-4, 1800.0)]
SLOW_BLEU = [(20, 3.25), (40, 7.5)]


@pytest.fixture
def runs(tmp_path: Path) -> dict[str, Path]:
    return {"fast": metrics_folder(tmp_path / "a" / "metrics", FAST_TRAIN, FAST_BLEU),
            "slow": metrics_folder(tmp_path / "b" / "metrics", SLOW_TRAIN, SLOW_BLEU)}


@pytest.fixture
def drawn(monkeypatch) -> list:
    """The figures the script saves (savefig still writes the file)."""
    figures = []
    save = matplotlib.figure.Figure.savefig

    def keep(fig, *args, **kwargs):
        figures.append(fig)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    return figures


def test_load_run_puts_each_bleu_step_at_its_interpolated_minute(runs):
    """BLEU steps get minutes by linear interpolation between logged steps; empty cells go."""
    train, bleu = curves.load_run(runs["fast"])
    assert train["minutes"].tolist() == pytest.approx([e / 60 for _, _, e in FAST_TRAIN])
    assert bleu["step"].tolist() == [15, 30, 40]
    assert bleu["valid_bleu"].tolist() == [5.0, 12.5, 11.0]
    # by hand: 15 is halfway from step 10 (1 min) to 20 (2 min); 30 and 40 are logged steps
    assert bleu["minutes"].tolist() == pytest.approx([1.5, 4.0, 5.0])


def test_each_run_prints_its_last_and_best_bleu(runs, tmp_path, capsys):
    """The printed table holds each run's last step and minutes, last and best BLEU."""
    out = tmp_path / "deep" / "er" / "curves.png"
    curves.main(["--run", f"fast={runs['fast']}", "--run", f"slow={runs['slow']}",
                 "--out", str(out)])
    captured = capsys.readouterr()
    rows = {line.split()[0]: line.split() for line in captured.out.splitlines()[1:]}
    assert rows["fast"] == ["fast", "40", "5.0", "11.00", "12.50", "(30)"]
    assert rows["slow"] == ["slow", "40", "30.0", "7.50", "7.50", "(40)"]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # its folders were made
    assert f"wrote {out}" in captured.err


@pytest.mark.parametrize("axis", ["minutes", "steps"])
def test_the_curves_are_bleu_above_and_lr_below_on_the_chosen_axis(runs, tmp_path,
                                                                  drawn, axis):
    """Plotted points are the logs' BLEU and lr against minutes or steps, one colour a run."""
    curves.main(["--run", f"fast={runs['fast']}", "--run", f"slow={runs['slow']}",
                 "--out", str(tmp_path / "c.png"), "--x", axis])
    (fig,) = drawn
    bleu_ax, lr_ax = fig.axes
    by_minutes = axis == "minutes"
    assert bleu_ax.get_title() == ("greedy validation BLEU against training "
                                   + ("time" if by_minutes else "steps"))
    assert lr_ax.get_xlabel() == "training " + axis
    assert [t.get_text() for t in bleu_ax.get_legend().get_texts()] == ["fast", "slow"]
    fast_bleu, slow_bleu = bleu_ax.get_lines()
    fast_lr, slow_lr = lr_ax.get_lines()
    assert list(fast_bleu.get_xdata()) == pytest.approx([1.5, 4.0, 5.0] if by_minutes
                                                        else [15, 30, 40])
    assert list(fast_bleu.get_ydata()) == [5.0, 12.5, 11.0]
    assert list(slow_bleu.get_xdata()) == pytest.approx([10.0, 30.0] if by_minutes
                                                        else [20, 40])
    assert list(fast_lr.get_xdata()) == pytest.approx(
        [e / 60 if by_minutes else s for s, _, e in FAST_TRAIN])
    assert list(fast_lr.get_ydata()) == pytest.approx([lr for _, lr, _ in FAST_TRAIN])
    assert list(slow_lr.get_ydata()) == pytest.approx([lr for _, lr, _ in SLOW_TRAIN])
    assert fast_lr.get_color() == fast_bleu.get_color()
    assert slow_lr.get_color() == slow_bleu.get_color()
    assert fast_bleu.get_color() != slow_bleu.get_color()


def test_past_ten_runs_no_two_runs_look_alike(runs, tmp_path, drawn):
    """matplotlib's cycle has ten colours: the eleventh run would repeat the first. Twelve
    runs get twelve (colour, line style) pairs, and each lr line is drawn as its BLEU line."""
    specs = [a for i in range(12) for a in ("--run", f"r{i}={runs['fast']}")]
    curves.main([*specs, "--out", str(tmp_path / "c.png")])
    (fig,) = drawn
    bleu_ax, lr_ax = fig.axes

    def look(line):
        return (line.get_color(), line.get_linestyle())

    assert len({look(line) for line in bleu_ax.get_lines()}) == 12
    assert [look(line) for line in lr_ax.get_lines()] == [look(line) for line in
                                                          bleu_ax.get_lines()]


def test_a_title_given_replaces_the_default(runs, tmp_path, drawn):
    """--title is the BLEU panel's title as given."""
    curves.main(["--run", f"fast={runs['fast']}", "--out", str(tmp_path / "c.png"),
                 "--title", "d256 against tiny"])
    assert drawn[0].axes[0].get_title() == "d256 against tiny"


@pytest.mark.parametrize("spec", ["metrics", "=metrics"])
def test_a_run_without_a_label_stops_with_the_form_to_use(tmp_path, spec):
    """--run FOLDER or =FOLDER is an error naming LABEL=FOLDER; no picture is written."""
    out = tmp_path / "c.png"
    with pytest.raises(SystemExit, match="write it LABEL=FOLDER"):
        curves.main(["--run", spec, "--out", str(out)])
    assert not out.exists()


@pytest.mark.parametrize("missing", ["train_log.tsv", "valid_bleu.tsv"])
def test_a_folder_without_a_log_names_the_file_and_the_setting(runs, tmp_path,
                                                               missing):
    """A missing log is named, with train.valid_bleu_every as the fix; nothing is written."""
    (runs["fast"] / missing).unlink()
    out = tmp_path / "c.png"
    with pytest.raises(SystemExit) as stop:
        curves.main(["--run", f"fast={runs['fast']}", "--out", str(out)])
    assert f"has no {missing}" in str(stop.value)
    assert "train.valid_bleu_every > 0" in str(stop.value)
    assert not out.exists()


def test_a_training_without_validation_bleu_stops_with_the_setting_to_change(runs,
                                                                            tmp_path):
    """A header-only valid_bleu.tsv (what the trainer writes with valid_bleu_every 0) stops
    with the script's message naming the file and the setting, and no picture is written."""
    (runs["fast"] / "valid_bleu.tsv").write_text("step\tvalid_bleu\n")
    with pytest.raises(SystemExit, match="train.valid_bleu_every > 0") as stop:
        curves.main(["--run", f"fast={runs['fast']}", "--out", str(tmp_path / "c.png")])
    assert str(runs["fast"] / "valid_bleu.tsv") in str(stop.value)
    assert not (tmp_path / "c.png").exists()


def test_by_tokens_with_a_marked_budget(tmp_path, drawn):
    """--x tokens places each BLEU step at its interpolated count of target tokens trained on
    (millions), and --mark draws a labelled line at a budget on both panels."""
    folder = metrics_folder(tmp_path / "m", [(10, 1e-3, 60.0), (20, 1e-3, 120.0)], [(15, 9.0),
                                                                                  (20, 10.0)])
    log = folder / "train_log.tsv"  # cumulative tokens 2M at step 10, 6M at step 20
    log.write_text(log.read_text().replace("\t900\t", "\t{}\t").format(2_000_000, 6_000_000))
    curves.main(["--run", f"r={folder}", "--out", str(tmp_path / "c.png"), "--x", "tokens",
                 "--mark", "8=published budget"])
    (fig,) = drawn
    bleu_ax, lr_ax = fig.axes
    assert bleu_ax.get_title() == "greedy validation BLEU against training target tokens"
    assert lr_ax.get_xlabel() == "target tokens trained on (millions)"
    run, mark = bleu_ax.get_lines()
    assert list(run.get_xdata()) == pytest.approx([4.0, 6.0])  # step 15: halfway, 4M
    assert list(mark.get_xdata()) == [8.0, 8.0] and list(lr_ax.get_lines()[1].get_xdata()) == [
        8.0, 8.0]
    assert [t.get_text() for t in bleu_ax.texts] == ["published budget"]


@pytest.mark.parametrize("summary, expected", [
    # R-Drop from step 21: by step 30 its 4M tokens (6M -> 10M) went through twice
    ({"rdrop": 5.0, "rdrop_from_step": 21}, [4.0, 14.0]),
    # the same on half of each batch's sentences: half of those 4M a second time
    ({"rdrop": 5.0, "rdrop_from_step": 21, "rdrop_fraction": 0.5}, [4.0, 12.0]),
    ({"rdrop": 5.0}, [8.0, 20.0]),                          # a run from before the key: all
    # from before the key, with rdrop_start and a budget of 30 steps: past 0.6 of them, from 20
    ({"rdrop": 5.0, "rdrop_start": 0.6, "max_minutes": 0, "stopped_by": "steps",
      "steps": 30}, [4.2, 14.4]),  # 5.6M at step 19 (interpolated): 4.4M twice
    ({"rdrop": 5.0, "rdrop_from_step": None}, [4.0, 10.0]),  # never reached its start
    ({"rdrop": 0.0, "rdrop_from_step": None}, [4.0, 10.0]),  # no R-Drop
    (None, [4.0, 10.0]),                                     # no train.json
])
def test_by_passes_r_drop_tokens_count_twice(tmp_path, drawn, summary, expected):
    folder = metrics_folder(tmp_path / "m", [(10, 1e-3, 60.0), (20, 1e-3, 120.0),
                                             (30, 1e-3, 180.0)], [(15, 9.0), (30, 10.0)])
    log = folder / "train_log.tsv"  # cumulative tokens 2M, 6M, 10M at steps 10, 20, 30
    log.write_text(log.read_text().replace("\t900\t", "\t{}\t").format(
        2_000_000, 6_000_000, 10_000_000))
    if summary is not None:
        (folder / "train.json").write_text(json.dumps(summary))
    curves.main(["--run", f"r={folder}", "--out", str(tmp_path / "c.png"), "--x", "passes"])
    (fig,) = drawn
    bleu_ax, lr_ax = fig.axes
    assert lr_ax.get_xlabel().startswith("target tokens through the model (millions")
    assert list(bleu_ax.get_lines()[0].get_xdata()) == pytest.approx(expected)


def test_a_mark_that_is_not_a_number_stops_with_the_form(runs, tmp_path):
    with pytest.raises(SystemExit, match="write it X=LABEL"):
        curves.main(["--run", f"fast={runs['fast']}", "--out", str(tmp_path / "c.png"),
                     "--mark", "lots=budget"])


def test_a_level_draws_a_labelled_horizontal_line_on_the_bleu_panel_only(runs, tmp_path,
                                                                        drawn):
    curves.main(["--run", f"fast={runs['fast']}", "--out", str(tmp_path / "c.png"),
                 "--level", "41.02=published best"])
    (fig,) = drawn
    bleu_ax, lr_ax = fig.axes
    run, level = bleu_ax.get_lines()
    assert list(level.get_ydata()) == [41.02, 41.02] and len(lr_ax.get_lines()) == 1
    assert [t.get_text() for t in bleu_ax.texts] == ["published best"]
    with pytest.raises(SystemExit, match="--level 'high=x': write it Y=LABEL, Y a number of "
                                         "BLEU"):
        curves.main(["--run", f"fast={runs['fast']}", "--out", str(tmp_path / "d.png"),
                     "--level", "high=x"])
