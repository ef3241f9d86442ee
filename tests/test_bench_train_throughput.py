"""bench/train_throughput.py: how ``--arm`` contenders are read and checked, and how a round's
figures leave validation out (no training here: the benchmark itself is timed by hand, never
in tests)."""

from __future__ import annotations

import pytest
import yaml

from bench import train_throughput as throughput
from tests.conftest import REPO


@pytest.fixture(scope="module")
def preset() -> dict:
    from stages.params import compose

    return yaml.safe_load(compose(REPO / "conf", "multi30k", []))


def test_an_arm_is_fast_with_its_settings_parsed_as_yaml():
    name, spec = throughput.parse_arm("d192:model.d_model=192,model.heads=3,train.compile=true")
    assert name == "d192"
    assert spec == {"kernels": "fast", "model": {"d_model": 192, "heads": 3}, "compile": True}


@pytest.mark.parametrize("text", ["model.d_ff=512", ":model.d_ff=512", "fast:model.d_ff=512",
                                  "x@8:model.d_ff=512", "x:data.vocab_size=4000",
                                  "x:model.d_ff", "x:d_ff=512"])
def test_a_malformed_arm_stops_with_the_form_to_use(text):
    with pytest.raises(SystemExit, match=r"--arm .*(NAME:KEY=VALUE|model\.KEY=VALUE)"):
        throughput.parse_arm(text)


def test_arms_are_validated_as_params_are_and_the_preset_is_untouched(preset):
    before = yaml.safe_dump(preset)
    arms = [throughput.parse_arm("ff512:model.d_ff=512"),
            throughput.parse_arm("l2:model.encoder_layers=2,model.decoder_layers=2")]
    checked = throughput.check_arms(preset, dict(arms))
    assert checked["ff512"].model.d_ff == 512
    assert checked["ff512"].model.d_model == preset["model"]["d_model"]
    assert (checked["l2"].model.encoder_layers, checked["l2"].model.decoder_layers) == (2, 2)
    assert checked["l2"].model.d_ff == preset["model"]["d_ff"]
    assert yaml.safe_dump(preset) == before


@pytest.mark.parametrize("setting, named", [("model.dff=512", "model.dff"),
                                            ("train.lr_sclae=2", "train.lr_sclae"),
                                            ("model.d_model=-8", "model.d_model")])
def test_a_misspelt_or_invalid_arm_setting_names_the_arm_and_the_key(preset, setting, named):
    with pytest.raises(SystemExit) as info:
        throughput.check_arms(preset, dict([throughput.parse_arm(f"typo:{setting}")]))
    assert "--arm typo" in str(info.value) and named in str(info.value)


def test_a_bad_arm_stops_the_run_before_any_data_is_made(tmp_path):
    work = tmp_path / "work"
    with pytest.raises(SystemExit, match="model.dff"):
        throughput.main(["--preset", "demo", "--workdir", str(work), "--contenders",
                         "fast,typo", "--arm", "typo:model.dff=64"])
    assert not work.exists() or not any(work.iterdir())
    assert "typo" not in throughput.TRAINERS  # an arm lives in its run, not in the module


def contenders(names: str, validate: str = "", arm: tuple = ()) -> throughput.Contenders:
    import argparse

    args = argparse.Namespace(contenders=names, arm=list(arm), baseline="HEAD", preset="demo",
                              set=[], profile=None, validate=validate)
    return throughput.choose_contenders(args)


def test_a_heap_suffix_runs_any_contender_on_that_allocator(monkeypatch):
    monkeypatch.setattr("aiayn.training.memory.allocator_library", lambda name: f"lib{name}.so")
    c = contenders("fast/tcmalloc,fast@2048/jemalloc,main/glibc,fast,matmul")
    assert c.heap == {"fast/tcmalloc": "tcmalloc", "fast@2048/jemalloc": "jemalloc",
                      "main/glibc": "glibc", "fast": None, "matmul": None}
    assert c.core["fast@2048/jemalloc"] == "fast@2048"
    assert c.base["fast@2048/jemalloc"] == "fast" and c.variant["fast@2048/jemalloc"] == 2048
    assert c.base["main/glibc"] == "main" and c.variant["main/glibc"] is None


@pytest.mark.parametrize(("names", "message"), [
    ("fast/mimalloc", "ALLOC one of glibc, jemalloc, tcmalloc"),
    ("fast/tcmalloc,matmul/tcmalloc", "matmul measures the products"),
    ("fast/tcmalloc,fast/tcmalloc", "name each contender once"),
    ("fast/jemalloc", "no jemalloc library here .*apt install libjemalloc2"),
])
def test_a_heap_that_cannot_run_stops_before_any_worker(monkeypatch, names, message):
    monkeypatch.setattr("aiayn.training.memory.allocator_library",
                        lambda name: "libtcmalloc.so" if name == "tcmalloc" else None)
    with pytest.raises(SystemExit, match=message):
        contenders(names)


def test_ratios_pair_contenders_whatever_their_heap_and_each_heap_with_the_others(monkeypatch):
    monkeypatch.setattr("aiayn.training.memory.allocator_library", lambda name: f"lib{name}.so")
    names = ["fast/tcmalloc", "fast/glibc", "main/glibc", "plain", "fast@2048"]
    c = contenders(",".join(names))
    pairs = throughput.ratio_pairs(c, names)
    assert pairs == [("fast/tcmalloc", "main/glibc"), ("fast/glibc", "main/glibc"),
                     ("fast/tcmalloc", "plain"), ("fast/glibc", "plain"),
                     ("plain", "main/glibc"), ("fast/tcmalloc", "fast/glibc")]
    assert len(set(pairs)) == len(pairs)
    # without suffixes, as before: PAIRS in their order, then each batch size against fast
    plain = contenders("fast,main,plain,fast@2048")
    assert throughput.ratio_pairs(plain, plain.names) == [
        ("fast", "main"), ("fast", "plain"), ("plain", "main"), ("fast@2048", "fast")]


@pytest.mark.skipif(not __import__("aiayn.fast.linear", fromlist=["x"]).ONEDNN_LINEAR,
                    reason="this torch has no oneDNN linear")
def test_the_onednn_census_counts_primitives_built_only_for_new_shapes(capfd):
    """Steps that multiply row counts met before build nothing; steps that multiply a new
    row count each build at least one primitive and run as many as the others (through
    oneDNN's fp32 linear, which any x86 CPU runs; how many primitives one product takes,
    reorders included, is the CPU's business). Counted from oneDNN's own log, which never
    reaches the stream the coordinator reads."""
    import io

    import torch

    w = torch.randn(16, 8)
    rows = iter(range(40, 50))

    def product(m):
        torch.ops.mkldnn._linear_pointwise(torch.randn(m, 8), w, None, "none", [], "")

    product(32)  # met before counting
    met = throughput.onednn_census(lambda: product(32), 2, io.StringIO())
    new = throughput.onednn_census(lambda: product(next(rows)), 2, io.StringIO())
    assert met["built"] == 0 and met["ran"] > 0 and met["reused"] > 0
    assert new["built"] >= 1 and new["ran"] == met["ran"] and new["steps"] == 2
    assert new["distinct"] > met["distinct"]  # two row counts' problems against one's
    assert "onednn_verbose" not in capfd.readouterr().out


def test_validation_comes_at_the_trainers_cadence_and_a_bleu_step_validates_too():
    """Brute force over 60 steps: the valid loss every 10 steps, BLEU every 15 (a BLEU step
    validates even off the loss's cadence); BLEU 0 is off."""
    due = {s: throughput.validation_due(s, 10, 15) for s in range(1, 61)}
    assert [s for s, (v, _) in due.items() if v] == [10, 15, 20, 30, 40, 45, 50, 60]
    assert [s for s, (_, b) in due.items() if b] == [15, 30, 45, 60]
    assert not any(throughput.validation_due(s, 10, 0)[1] for s in range(1, 61))


def test_a_rounds_figures_leave_out_its_validation_passes(monkeypatch):
    """A worker whose steps take 1 s and 100 page faults, with a 10 s pass of 7 faults after
    every second step (BLEU after every fourth): four steps report 4 s, 400 faults and the
    passes beside them; the next round starts its count afresh. A clock and fault counter
    that move only when the fake worker works stand in for the machine's."""
    import resource
    import time
    import types

    clock = {"t": 0.0, "faults": 0}
    monkeypatch.setattr(time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(time, "process_time", lambda: 2 * clock["t"])  # two busy threads
    monkeypatch.setattr(resource, "getrusage",
                        lambda who: types.SimpleNamespace(ru_minflt=clock["faults"]))

    class Worker:
        def __init__(self):
            self.paused, self.n = throughput.Paused(), 0

        def step(self):
            self.n += 1
            clock["t"] += 1.0
            clock["faults"] += 100
            if self.n % 2 == 0:
                with self.paused.measure(bleu=self.n % 4 == 0):
                    clock["t"] += 10.0
                    clock["faults"] += 7

        def extra(self):
            return {}

    w = Worker()
    first = throughput.timed_run(w, 4)
    assert (first["wall"], first["cpu"], first["faults"]) == (4.0, 8.0, 400)
    assert first["validation"] == {"wall": 20.0, "cpu": 40.0, "faults": 14, "passes": 2,
                                   "bleu_passes": 1}
    second = throughput.timed_run(w, 1)  # step 5: no pass
    assert (second["wall"], second["faults"]) == (1.0, 100) and "validation" not in second


def test_validate_names_trainer_contenders_of_the_run():
    c = contenders("fast,valid,matmul", validate="valid", arm=["valid:"])
    assert c.base["valid"] == "valid" and c.trainers["valid"] == {"kernels": "fast",
                                                                  "model": {}}
    for bad in ("matmul", "plain"):  # products only; not in this run
        with pytest.raises(SystemExit, match=f"--validate {bad}: name trainer contenders"):
            contenders("fast,valid,matmul", validate=bad, arm=["valid:"])


def test_a_rounds_progress_line_gives_each_workers_rate_and_resident_memory():
    replies = {"fast": {"wall": 2.0, "rss_mib": 1536.4},
               "valid": {"wall": 4.0, "rss_mib": 2047.6},
               "matmul": {"gflops": {"4096x256x1024": 71.2, "256x256x256": 40.0}},
               "nomem": {"wall": 1.0, "rss_mib": None}}  # no /proc: no figure
    line = throughput.round_line(replies, {"fast": 5000, "valid": 5000, "nomem": 300})
    assert line == ("target tok/s: fast 2500  valid 1250  nomem 300  matmul 71/40 GFLOP/s"
                    "  | RSS MiB: fast 1536  valid 2048")
    assert throughput.round_line({"fast": {"wall": 1.0}}, {"fast": 10}) == \
        "target tok/s: fast 10"
