"""bench/train_memory.py: its window and summary arithmetic against plain recomputations, the
run loop with stand-in workers (argv, order, JSON), and its argument checks."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench import train_memory as memory
from tests.conftest import usage_error


def fake_run(mode: str, steps: int, seed: int) -> dict:
    """A worker's result: an RSS that creeps up by a mode-dependent slope, with noise."""
    rng = np.random.default_rng(seed)
    slope = 3.0 if mode == "notrim" else 0.5
    rss = (1000 + slope * np.arange(steps) + rng.uniform(0, 20, steps)).round(1)
    secs = rng.uniform(0.1, 0.2, steps).round(4)
    return {"mode": mode, "precision": "fp32", "rss_mib": rss.tolist(), "step_s": secs.tolist()}


@pytest.mark.parametrize("warmup", [1, 2, 7, 20])
@pytest.mark.parametrize("after", [1, 2, 4, 5, 6, 9, 10, 11, 29, 280])
def test_windows_are_the_warmup_then_up_to_five_about_equal_windows(warmup, after):
    """Edges 0, warmup, .., steps: min(5, n) windows after it, n//5 long, the last + rest."""
    # n = steps after the warm-up; the last window takes the remainder (under 5 more steps)
    steps = warmup + after
    edges = memory.windows(warmup, steps)
    assert edges[:2] == [0, warmup] and edges[-1] == steps
    lengths = np.diff(edges[1:]).tolist()
    assert len(lengths) == min(5, after)
    assert all(n > 0 for n in lengths)
    if after >= 5:
        assert lengths[:4] == [after // 5] * 4
        assert lengths[4] >= after // 5
        assert lengths[4] - after // 5 < 5


def test_window_max_is_the_peak_of_steps_start_plus_one_to_stop():
    """window_max(rss, a, b) is the largest RSS of 1-based steps a+1..b (rss[0] is step 1)."""
    rss = [5.0, 9.0, 1.0, 7.0, 3.0, 8.0]
    for a in range(len(rss)):
        for b in range(a + 1, len(rss) + 1):
            assert memory.window_max(rss, a, b) == max(
                rss[step - 1] for step in range(a + 1, b + 1))


def test_summarise_takes_the_warmup_and_last_window_peaks_and_the_median_step():
    """peak_warmup, peak_last, growth, peak and s/step as recomputed from the run's lists."""
    run = fake_run("notrim", 40, seed=1)
    edges = [0, 8, 14, 20, 26, 32, 40]
    s = memory.summarise(run, edges)
    rss, secs = np.array(run["rss_mib"]), np.array(run["step_s"])
    assert s["mode"] == "notrim"
    assert s["peak_warmup"] == rss[:8].max()
    assert s["peak_last"] == rss[32:].max()
    assert s["growth"] == pytest.approx(rss[32:].max() - rss[:8].max())
    assert s["peak"] == rss.max()
    assert s["s_per_step"] == pytest.approx(float(np.median(secs[8:])))


class Calls(list):
    """The workers' argv, and in .envs the environment each was started with."""

    def __init__(self):
        super().__init__()
        self.envs: list[dict | None] = []


@pytest.fixture
def workers(monkeypatch):
    """subprocess.run standing in for the worker processes: each call's argv is recorded
    and answered with a fake_run of its mode, after a line of chatter on stdout."""
    calls = Calls()

    def run(cmd, **kwargs):
        calls.append(cmd)
        calls.envs.append(kwargs.get("env"))
        mode = cmd[cmd.index("--worker") + 1]
        steps = int(cmd[cmd.index("--steps") + 1])
        out = "loading ...\n" + json.dumps(fake_run(mode, steps, seed=len(calls))) + "\n"
        return subprocess.CompletedProcess(cmd, 0, stdout=out, stderr="")

    monkeypatch.setattr(memory.subprocess, "run", run)
    # the data stages and the trainer spec, recorded instead of made
    monkeypatch.setattr(memory, "prepare", lambda args: {"stand-in": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}})
    return calls


def test_a_run_alternates_the_modes_and_writes_the_summaries_and_ratios(workers,
                                                                        tmp_path, capsys):
    """Workers alternate notrim/trim; JSON, summaries and ratios match a recomputation."""
    out = tmp_path / "memory.json"
    result = memory.main(["--steps", "30", "--warmup", "5", "--repeats", "2",
                          "--max-tokens", "512", "--precision", "fp32", "--seed", "7",
                          "--json", str(out)])
    modes = [cmd[cmd.index("--worker") + 1] for cmd in workers]
    assert modes == ["notrim", "trim", "notrim", "trim"]
    for cmd in workers:
        assert cmd[:3] == [sys.executable, "-m", "bench.train_memory"]
        assert cmd[cmd.index("--steps") + 1] == "30"
        asked = json.loads(cmd[cmd.index("--spec") + 1])["stand-in"]  # what prepare was given
        assert (asked["max_tokens"], asked["seed"], asked["precision"]) == (512, 7, "fp32")
    assert json.loads(out.read_text()) == result
    assert result["args"] == {"steps": 30, "warmup": 5, "repeats": 2, "max_tokens": 512,
                              "precision": "fp32", "seed": 7, "preset": "multi30k", "set": [],
                              "corpus": None, "workdir": asked["workdir"],
                              "trim_every": None, "modes": ["notrim", "trim"]}
    assert result["runs"] == [fake_run(m, 30, seed=i) for i, m in enumerate(modes, start=1)]
    # by hand: warm-up steps 1-5, then windows of 5 steps; the last is steps 26-30
    for s, run in zip(result["summary"], result["runs"], strict=True):
        assert s["peak_warmup"] == max(run["rss_mib"][:5])
        assert s["peak_last"] == max(run["rss_mib"][25:])
        assert s["s_per_step"] == pytest.approx(statistics.median(run["step_s"][5:]))
    notrim, trim = result["summary"][0::2], result["summary"][1::2]
    ratios = [t["peak_last"] / n["peak_last"] for n, t in zip(notrim, trim, strict=True)]
    speeds = [t["s_per_step"] / n["s_per_step"] for n, t in zip(notrim, trim, strict=True)]
    assert result["ratio_peak_last"] == pytest.approx(sum(ratios) / 2)  # median of two
    assert result["ratio_s_per_step"] == pytest.approx(sum(speeds) / 2)
    printed = capsys.readouterr().out
    assert f"x{sum(ratios) / 2:.2f}" in printed and "(median over 2 pair(s))" in printed
    # the window table: one column per window, each the peak over its steps
    table = printed.split("peak RSS (MiB) over steps\n")[1].splitlines()
    assert table[0].split() == ["mode", "1-5", "6-10", "11-15", "16-20", "21-25", "26-30"]
    for line, run in zip(table[1:5], result["runs"], strict=True):
        rss = run["rss_mib"]
        assert line.split() == [run["mode"], *(f"{max(rss[a:a + 5]):.0f}"
                                               for a in range(0, 30, 5))]


def test_a_failed_worker_stops_the_run_with_its_error(monkeypatch, tmp_path):
    """A worker's non-zero exit stops the run naming the mode, the status and its stderr."""
    def run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 3, stdout="", stderr="Traceback: no luck\n")

    monkeypatch.setattr(memory.subprocess, "run", run)
    monkeypatch.setattr(memory, "prepare", lambda args: {})
    out = tmp_path / "memory.json"
    with pytest.raises(SystemExit) as stop:
        memory.main(["--steps", "10", "--warmup", "2", "--json", str(out)])
    assert "the notrim worker failed (exit 3)" in str(stop.value)
    assert "Traceback: no luck" in str(stop.value)
    assert not out.exists()


@pytest.mark.parametrize("warmup, steps", [(20, 20), (30, 10), (0, 10)])
def test_a_warmup_outside_one_to_below_the_steps_is_an_argument_error(workers, capsys,
                                                                      warmup, steps):
    """--warmup of 0 or >= --steps exits 2 naming both values, before any worker starts (a
    warm-up of 0 has no window to take the baseline peak from)."""
    err = usage_error(lambda: memory.main(["--steps", str(steps), "--warmup", str(warmup)]),
                      capsys)
    assert f"--warmup ({warmup}) must be at least 1 and below --steps ({steps})" in err
    assert workers == []


def test_trim_every_reaches_the_workers_and_must_be_positive(workers, capsys):
    """--trim-every N goes into every worker's spec; 0 exits 2 before any worker starts."""
    memory.main(["--steps", "12", "--warmup", "2", "--trim-every", "4"])
    assert [json.loads(cmd[cmd.index("--spec") + 1])["trim_every"] for cmd in workers] == [4, 4]
    workers.clear()
    assert "--trim-every (0) must be at least 1" in usage_error(
        lambda: memory.main(["--steps", "12", "--warmup", "2", "--trim-every", "0"]), capsys)
    assert workers == []


def test_no_repeats_is_an_argument_error(workers, capsys):
    """--repeats 0 exits 2 naming the value, before any worker starts."""
    assert "--repeats (0) must be at least 1" in usage_error(
        lambda: memory.main(["--steps", "10", "--warmup", "2", "--repeats", "0"]), capsys)
    assert workers == []


@pytest.mark.slow
def test_a_real_run_trains_the_trainer_in_both_modes_and_records_every_step(tmp_path):
    """End to end on the toy preset: the data stages run once, each mode's worker process
    trains the real trainer for the steps asked, one RSS and one time per step, in the
    precision `aiayn train` picks on this CPU, and the JSON holds what main returned."""
    from aiayn.precision import autocast_dtype

    out = tmp_path / "memory.json"
    result = memory.main(["--preset", "demo", "--steps", "4", "--warmup", "1",
                          "--workdir", str(tmp_path / "work"), "--json", str(out)])
    assert json.loads(out.read_text()) == result
    expected = "bf16" if autocast_dtype("auto", __import__("torch").device("cpu")) else "fp32"
    assert [r["mode"] for r in result["runs"]] == ["notrim", "trim"]
    for run in result["runs"]:
        assert run["precision"] == expected
        assert len(run["rss_mib"]) == 4 and len(run["step_s"]) == 4
        assert min(run["rss_mib"]) > 0 and min(run["step_s"]) > 0
    assert (tmp_path / "work" / "demo" / "data" / "shards" / "train").is_dir()


def test_allocator_modes_run_preloaded_in_the_order_given_each_against_the_first(
        workers, monkeypatch, capsys):
    """--modes trim,jemalloc,tcmalloc: each repeat runs them in that order; the allocator
    modes' workers start with their library first in LD_PRELOAD, the trim mode's without
    one; each later mode's ratios are the medians of its runs over the first mode's."""
    monkeypatch.setattr("aiayn.training.memory.allocator_library",
                        lambda name: f"lib{name}.so.test")
    monkeypatch.setattr(memory, "allocator_library", lambda name: f"lib{name}.so.test")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    result = memory.main(["--steps", "12", "--warmup", "2", "--repeats", "2",
                          "--modes", "trim,jemalloc,tcmalloc"])
    modes = [cmd[cmd.index("--worker") + 1] for cmd in workers]
    assert modes == ["trim", "jemalloc", "tcmalloc"] * 2
    preloads = [env.get("LD_PRELOAD") for env in workers.envs]
    assert preloads == [None, "libjemalloc.so.test", "libtcmalloc.so.test"] * 2
    summary = result["summary"]
    for i, mode in ((1, "jemalloc"), (2, "tcmalloc")):
        ratios = [summary[i + 3 * r]["s_per_step"] / summary[3 * r]["s_per_step"]
                  for r in range(2)]
        assert result["ratios"][mode]["s_per_step"] == pytest.approx(sum(ratios) / 2)
        peaks = [summary[i + 3 * r]["peak_last"] / summary[3 * r]["peak_last"]
                 for r in range(2)]
        assert result["ratios"][mode]["peak_last"] == pytest.approx(sum(peaks) / 2)
    assert result["ratio_s_per_step"] == result["ratios"]["jemalloc"]["s_per_step"]
    printed = capsys.readouterr().out
    assert "jemalloc / trim:" in printed and "tcmalloc / trim:" in printed


@pytest.mark.parametrize(("modes", "message"), [
    ("trim", "give two or more of"),
    ("trim,trim", "each once"),
    ("trim,mimalloc", "give two or more of"),
    ("trim,jemalloc", "no jemalloc library here (e.g. `apt install libjemalloc2`"),
])
def test_modes_that_cannot_run_are_argument_errors(workers, monkeypatch, capsys, modes,
                                                   message):
    """Fewer than two modes, a repeated or unknown one, or an allocator that is not
    installed exit 2 before any worker starts."""
    monkeypatch.setattr("aiayn.training.memory.allocator_library", lambda name: None)
    monkeypatch.setattr(memory, "allocator_library", lambda name: None)
    err = usage_error(lambda: memory.main(["--steps", "10", "--warmup", "2", "--modes", modes]),
                      capsys)
    assert message in err
    assert workers == []
