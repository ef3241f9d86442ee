"""bench/train_throughput.py: how contenders (``--arm``, ``/ALLOC``) are read and checked, and
what a round reports (no training here: the benchmark itself is timed by hand, never in
tests)."""

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
                                  "x/glibc:model.d_ff=512", "x:data.vocab_size=4000",
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


def contenders(names: str, arm: tuple = ()) -> throughput.Contenders:
    import argparse

    args = argparse.Namespace(contenders=names, arm=list(arm), baseline="HEAD", preset="demo",
                              set=[], profile=None)
    return throughput.choose_contenders(args)


def test_a_heap_suffix_runs_any_contender_on_that_allocator(monkeypatch):
    monkeypatch.setattr("aiayn.training.memory.allocator_library", lambda name: f"lib{name}.so")
    c = contenders("fast/tcmalloc,ff512/jemalloc,main/glibc,fast,matmul",
                   arm=["ff512:model.d_ff=512"])
    assert c.heap == {"fast/tcmalloc": "tcmalloc", "ff512/jemalloc": "jemalloc",
                      "main/glibc": "glibc", "fast": None, "matmul": None}
    assert c.core == {"fast/tcmalloc": "fast", "ff512/jemalloc": "ff512", "main/glibc": "main",
                      "fast": "fast", "matmul": "matmul"}
    assert c.trainers["ff512"] == {"kernels": "fast", "model": {"d_ff": 512}}


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
    names = ["fast/tcmalloc", "fast/glibc", "main/glibc", "plain"]
    c = contenders(",".join(names))
    pairs = throughput.ratio_pairs(c, names)
    assert pairs == [("fast/tcmalloc", "main/glibc"), ("fast/glibc", "main/glibc"),
                     ("fast/tcmalloc", "plain"), ("fast/glibc", "plain"),
                     ("plain", "main/glibc"), ("fast/tcmalloc", "fast/glibc")]
    assert len(set(pairs)) == len(pairs)
    # without suffixes: PAIRS in their order, then each arm against fast
    plain = contenders("fast,main,plain,ff512", arm=["ff512:model.d_ff=512"])
    assert throughput.ratio_pairs(plain, plain.names) == [
        ("fast", "main"), ("fast", "plain"), ("plain", "main"), ("ff512", "fast")]


def test_a_timed_run_reports_wall_and_cpu_seconds_page_faults_and_memory(monkeypatch):
    """Four steps of a worker whose steps take 1 s on two busy threads and 100 page faults
    each: 4 s wall, 8 s CPU, 400 faults, the resident memory after them and what the
    worker adds (the matmul rates, compiled graphs). A clock and fault counter that move only
    when the fake worker works stand in for the machine's."""
    import resource
    import time
    import types

    clock = {"t": 0.0, "faults": 0}
    monkeypatch.setattr(time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(time, "process_time", lambda: 2 * clock["t"])
    monkeypatch.setattr(resource, "getrusage",
                        lambda who: types.SimpleNamespace(ru_minflt=clock["faults"]))
    monkeypatch.setattr(throughput.harness, "rss_mib", lambda: 1536.0)

    class Worker:
        def step(self):
            clock["t"] += 1.0
            clock["faults"] += 100

        def extra(self):
            return {"graphs": 2}

    assert throughput.timed_run(Worker(), 4) == {"wall": 4.0, "cpu": 8.0, "faults": 400,
                                                 "rss_mib": 1536.0, "graphs": 2}


def test_a_rounds_progress_line_gives_each_workers_rate_and_resident_memory():
    replies = {"fast": {"wall": 2.0, "rss_mib": 1536.4},
               "plain": {"wall": 4.0, "rss_mib": 2047.6},
               "matmul": {"gflops": {"4096x256x1024": 71.2, "256x256x256": 40.0}},
               "nomem": {"wall": 50.0, "rss_mib": None}}  # no /proc: no figure
    line = throughput.round_line(replies, 5000)
    assert line == ("target tok/s: fast 2500  plain 1250  nomem 100  matmul 71/40 GFLOP/s"
                    "  | RSS MiB: fast 1536  plain 2048")
    assert throughput.round_line({"fast": {"wall": 1.0}}, 10) == "target tok/s: fast 10"
