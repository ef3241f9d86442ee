"""The run log's typed rows: saved in checkpoints as plain lists, read back, written as TSV,
and the questions the loop and the average stage ask of them."""

from __future__ import annotations

import csv
import math

import torch

from aiayn.training.run_log import RunLog, TrainRow, ValidRow, columns


def sample() -> RunLog:
    return RunLog(
        [TrainRow(2, 3.5, 3.25, 1e-3, float("nan"), 200, 1234.5, 1.5),
         TrainRow(4, 3.0, 2.75, 2e-3, 0.5, 400, 1500.0, 3.0)],
        [ValidRow(2, 4.0, 3.8, math.exp(3.8), 90, None),
         ValidRow(4, 3.5, 3.2, math.exp(3.2), 90, 12.5),
         ValidRow(6, 3.4, 3.1, math.exp(3.1), 90, 14.0),
         ValidRow(8, 3.3, 3.0, math.exp(3.0), 90, 12.5)])


def test_rows_round_trip_through_a_checkpoint_as_plain_lists(tmp_path):
    log = sample()
    saved = log.to_saved()
    assert saved["train_rows"][1] == [4, 3.0, 2.75, 2e-3, 0.5, 400, 1500.0, 3.0]
    assert saved["valid_rows"][0][-1] is None
    torch.save({"run": saved}, tmp_path / "c.pt")  # what a checkpoint holds
    back = RunLog.from_saved(torch.load(tmp_path / "c.pt", weights_only=True)["run"])
    assert back.valid == log.valid
    assert [r.step for r in back.train] == [2, 4] and math.isnan(back.train[0].grad_norm)


def test_rows_saved_before_the_bleu_column_existed_read_as_not_measured():
    old = {"train_rows": [[2, 3.5, 3.25, 1e-3, 0.1, 200, 1234.5, 1.5]],
           "valid_rows": [[2, 4.0, 3.8, 44.7, 90]]}  # five columns: before valid_bleu
    log = RunLog.from_saved(old)
    assert log.valid == [ValidRow(2, 4.0, 3.8, 44.7, 90, None)]
    assert log.scored() == [] and log.bleu_summary(1.0, 10.0) == {}


def test_questions_of_the_bleu_rows():
    log = sample()
    assert log.bleu_at(6) == 14.0 and log.bleu_at(2) is None and log.bleu_at(3) is None
    assert log.best_bleu_steps(1) == {6}
    assert log.best_bleu_steps(2) == {6, 8}  # of equal scores, the later
    summary = log.bleu_summary(bleu_seconds=2.0, elapsed_s=8.0)
    # the last measured, the best and the earliest step that reached it, BLEU's time share
    assert summary == {"valid_bleu": 12.5, "best_valid_bleu": 14.0, "best_valid_bleu_step": 6,
                       "valid_bleu_seconds": 2.0, "valid_bleu_share": 0.25}
    assert ValidRow(4, 3.5, 3.2, 24.5, 90, 12.5).metrics() == {
        "valid/loss": 3.5, "valid/nll": 3.2, "valid/ppl": 24.5, "valid/sacrebleu": 12.5}
    assert "valid/sacrebleu" not in ValidRow(2, 4.0, 3.8, 44.7, 90).metrics()
    assert set(sample().train[0].metrics()) == {"train/loss", "train/nll", "train/lr",
                                               "train/grad_norm", "train/tokens_per_s"}


def test_the_tsv_files_hold_every_row_and_bleu_only_where_measured(tmp_path):
    log = sample()
    paths = tmp_path / "train.tsv", tmp_path / "valid.tsv", tmp_path / "bleu.tsv"
    log.write(*paths)

    def read(path):
        with open(path, newline="") as f:
            return list(csv.reader(f, delimiter="\t"))

    train, valid, bleu = (read(p) for p in paths)
    assert tuple(train[0]) == columns(TrainRow) and len(train) == 3
    assert train[1][4] == "nan" and float(train[2][3]) == 2e-3
    assert tuple(valid[0]) == columns(ValidRow) and valid[1][-1] == "" and valid[2][-1] == "12.5"
    assert bleu == [["step", "valid_bleu"], ["4", "12.5"], ["6", "14"], ["8", "12.5"]]
    assert not list(tmp_path.glob("*.tmp"))  # written atomically, nothing left beside


def test_the_training_curves_name_the_best_valid_bleu_inside_its_panel(tmp_path, monkeypatch):
    """The BLEU panel marks its highest point and names its score and step in a legend drawn
    inside the panel, even when that point is the last and highest of the run (a label above
    it used to leave the panel)."""
    import matplotlib.pyplot as plt

    from aiayn.plots import plot_training_curves

    log = RunLog([TrainRow(s, 3.0, 2.8, 1e-3, 0.5, 400, 1500.0, s / 2) for s in (2, 4, 6, 8)],
                 [ValidRow(s, 3.5, 3.2, 24.5, 90, b)
                  for s, b in ((2, None), (4, 61.0), (6, 80.5), (8, 88.27))])
    log.write(tmp_path / "train.tsv", tmp_path / "valid.tsv", tmp_path / "bleu.tsv")
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at
    plot_training_curves(tmp_path / "train.tsv", tmp_path / "valid.tsv", tmp_path / "c.png")
    (fig,) = figures
    bleu_ax = next(ax for ax in fig.axes if ax.get_title() == "validation sacreBLEU")
    legend = bleu_ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["best 88.27 (step 8)"]
    renderer = fig.canvas.get_renderer()
    inside, box = legend.get_window_extent(renderer), bleu_ax.get_window_extent(renderer)
    assert box.x0 <= inside.x0 and inside.x1 <= box.x1
    assert box.y0 <= inside.y0 and inside.y1 <= box.y1
    monkeypatch.undo()
    plt.close(fig)


def test_the_best_bleu_legend_keeps_clear_of_a_curve_that_falls_at_the_end(tmp_path,
                                                                          monkeypatch):
    """A run that overfits ends with its BLEU low and late, at the panel's lower right: the
    legend goes where it covers none of the curve's points."""
    import matplotlib.pyplot as plt

    from aiayn.plots import plot_training_curves

    scores = ((2, 30.0), (4, 60.0), (6, 88.0), (8, 40.0), (10, 20.0), (12, 12.0))
    log = RunLog([TrainRow(s, 3.0, 2.8, 1e-3, 0.5, 400, 1500.0, s / 2) for s, _ in scores],
                 [ValidRow(s, 3.5, 3.2, 24.5, 90, b) for s, b in scores])
    log.write(tmp_path / "train.tsv", tmp_path / "valid.tsv", tmp_path / "bleu.tsv")
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    plot_training_curves(tmp_path / "train.tsv", tmp_path / "valid.tsv", tmp_path / "c.png")
    (fig,) = figures
    bleu_ax = next(ax for ax in fig.axes if ax.get_title() == "validation sacreBLEU")
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)  # place the legend as the saved picture has it
    legend = bleu_ax.get_legend().get_window_extent(renderer)
    points = bleu_ax.transData.transform([(s, b) for s, b in scores])
    covered = [scores[i] for i, (x, y) in enumerate(points)
               if legend.x0 <= x <= legend.x1 and legend.y0 <= y <= legend.y1]
    assert covered == []
    monkeypatch.undo()
    plt.close(fig)


def test_a_single_training_row_is_drawn(tmp_path, monkeypatch):
    """A run stopped after its first log row: its one train point shows in every panel (a
    matplotlib line of one point without a marker draws nothing)."""
    import matplotlib.pyplot as plt

    from aiayn.plots import plot_training_curves

    RunLog([TrainRow(25, 5.0, 4.5, 1e-3, 1.0, 1000, 5000.0, 1.0)],
           [ValidRow(25, 4.0, 3.8, math.exp(3.8), 500, None)]).write(
        tmp_path / "train.tsv", tmp_path / "valid.tsv", tmp_path / "bleu.tsv")
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    plot_training_curves(tmp_path / "train.tsv", tmp_path / "valid.tsv", tmp_path / "c.png")
    (fig,) = figures
    lines = [line for ax in fig.axes for line in ax.get_lines()
             if line.get_color() in ("tab:blue", "tab:green", "tab:purple")]
    assert len(lines) == 4  # train loss, train NLL, lr, tokens/s
    for line in lines:
        assert list(line.get_xdata()) == [25] and line.get_marker() not in (None, "None", "")
    monkeypatch.undo()
    plt.close(fig)
