"""bench/harness.py: the turns of alternating rounds and their ratios against a hand count,
the JSON record read back, the argument checks' usage errors, the CPU's kind from made-up
/proc/cpuinfo texts, and a baseline commit's library imported by a child process."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import harness
from tests.conftest import REPO, usage_error

# --------------------------------------------------------------------------- rounds


def test_rounds_rotate_by_one_so_each_contender_takes_every_place():
    turns = list(harness.rounds(["A", "B", "C"], 4))
    assert turns == [(0, ["A", "B", "C"]), (1, ["B", "C", "A"]), (2, ["C", "A", "B"]),
                     (3, ["A", "B", "C"])]
    assert [order for _, order in harness.rounds(["A", "B"], 3)] == [["A", "B"], ["B", "A"],
                                                                     ["A", "B"]]


def test_the_ratio_is_a_median_of_per_round_ratios():
    """The ratio summary of made-up times against a hand computation."""
    r = harness.ratio([2.0, 4.0, 6.0], [1.0, 1.0, 4.0])
    # by hand: 2/1, 4/1, 6/4 -> sorted 1.5, 2, 4: median 2, range 1.5 to 4
    assert r.per_round == (2.0, 4.0, 1.5)
    assert (r.median, r.low, r.high) == (2.0, 1.5, 4.0)
    assert str(r) == "2.00x (1.50-4.00)"
    assert harness.ratio([3.0, 1.0], [1.0, 1.0]).median == 2.0  # even count: the mean of two
    with pytest.raises(ValueError):  # every round has both sides
        harness.ratio([1.0, 2.0], [1.0])


# --------------------------------------------------------------------------- the JSON record


FACTS = {"cpu": "Made-up CPU 9000", "cpu_kind": "AVX2-only", "native_bf16": False,
         "instruction_caps": {"ONEDNN_MAX_CPU_ISA": "AVX2"}, "logical_cpus": 2,
         "cpu_capability": "avx2", "torch": "2.99", "threads": 2, "python": "3.11.0",
         "gpu": None}


def test_the_record_reads_back_as_written_with_argv_time_and_machine(tmp_path, capsys):
    out = tmp_path / "record.json"
    out.write_text("an older record\n")
    results = {"ratio": 1.25, "times": {"a": [0.5, 0.25]}, "shape": (3, 4),
               "where": Path("/some/folder"), "bleu": float("nan")}
    before = dt.datetime.now().astimezone().replace(microsecond=0)
    saved = harness.save(results, out, argv=["--rounds", "2"], machine=FACTS)
    assert capsys.readouterr().out == f"wrote {out}\n"
    assert json.loads(out.read_text()) == {
        "ratio": 1.25, "times": {"a": [0.5, 0.25]}, "shape": [3, 4], "where": "/some/folder",
        "bleu": None, "argv": ["--rounds", "2"], "time": saved["time"], "machine": FACTS}
    assert before <= dt.datetime.fromisoformat(saved["time"]) <= dt.datetime.now().astimezone()
    assert saved["ratio"] == 1.25 and saved["machine"] is FACTS
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]  # no temporary left
    # without a path nothing is written, and the facts are this machine's
    unsaved = harness.save({"x": 1}, None, argv=[])
    assert set(unsaved) == {"x", "argv", "time", "machine"}
    assert set(unsaved["machine"]) == set(FACTS)


def test_a_record_that_cannot_be_written_leaves_the_old_file(tmp_path):
    out = tmp_path / "record.json"
    out.write_text("an older record\n")
    with pytest.raises(ValueError):  # infinity is not JSON
        harness.save({"ratio": float("inf")}, out, argv=[], machine=FACTS)
    assert out.read_text() == "an older record\n"


def test_command_line_runs_the_module_again_with_its_arguments_quoted():
    line = harness.command_line("bench.attention", ["--lengths", "8,12", "--json", "a b.json"])
    assert line.endswith(" -m bench.attention --lengths 8,12 --json 'a b.json'")


# --------------------------------------------------------------------------- arguments


def checked(argv: list[str]) -> argparse.Namespace:
    ap = harness.parser(__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trim-every", type=int, default=None)
    ap.add_argument("--threads", default="2")
    args = ap.parse_args(argv)
    harness.require_positive(ap, args, "rounds", "trim_every")
    args.threads = harness.int_list(ap, "--threads", args.threads, "thread count")
    return args


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "--rounds (0) must be at least 1"),
    (["--trim-every", "-3"], "--trim-every (-3) must be at least 1"),
    (["--threads", "2,x"], "--threads '2,x': give thread counts separated by commas, e.g. 1,2"),
    (["--threads", "2,0"], "--threads '2,0': each thread count must be at least 1"),
])
def test_a_bad_argument_is_a_usage_error_naming_the_option(argv, message, capsys):
    err = usage_error(lambda: checked(argv), capsys)
    assert err.startswith("usage: ") and f"error: {message}" in err


def test_good_arguments_pass_and_an_unset_option_is_not_checked():
    args = checked(["--rounds", "1", "--threads", "2,1"])
    assert (args.rounds, args.trim_every, args.threads) == (1, None, [2, 1])


def test_the_parser_describes_the_script_by_its_docstrings_first_paragraph():
    ap = harness.parser("First line.\nSecond line.\n\nThe rest.", epilog=True)
    assert ap.description == "First line.\nSecond line." and ap.epilog == "The rest."
    assert harness.parser("Only this.").epilog is None


# --------------------------------------------------------------------------- machine facts

COMMON = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat sse sse2 ssse3 "
          "sse4_1 sse4_2 popcnt aes xsave avx f16c")


def cpuinfo(tmp_path: Path, flags: str, key: str = "flags") -> Path:
    """A two-processor /proc/cpuinfo with these flags (Arm: under "Features")."""
    path = tmp_path / "cpuinfo"
    block = (f"processor\t: {{}}\nvendor_id\t: MadeUp\nmodel name\t: Made-up CPU 9000\n"
             f"{key}\t\t: {flags}\n\n")
    path.write_text(block.format(0) + block.format(1))
    return path


@pytest.mark.parametrize("flags, kind", [
    (f"{COMMON} avx2 fma avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8", "AMX"),
    (f"{COMMON} avx2 fma avx512f avx512bw avx512_vnni avx512_bf16", "AVX512-BF16"),
    (f"{COMMON} avx2 fma avx512f avx512bw avx512_vnni", "AVX-512"),
    (f"{COMMON} avx2 fma bmi2 sha_ni", "AVX2-only"),
    (COMMON, "unknown"),
])
def test_the_cpus_kind_is_its_best_bf16_or_vector_flag(tmp_path, flags, kind):
    assert harness.cpu_hardware_kind(cpuinfo(tmp_path, flags)) == kind


def test_an_arm_cpus_kind_comes_from_its_features(tmp_path):
    assert harness.cpu_hardware_kind(cpuinfo(tmp_path, "fp asimd evtstrm aes sve i8mm bf16",
                                             "Features")) == "Arm BF16"
    assert harness.cpu_hardware_kind(cpuinfo(tmp_path, "fp asimd evtstrm aes", "Features")) == "Arm"
    assert harness.cpu_hardware_kind(tmp_path / "no-such-file") == "unknown"


def test_the_machine_line_names_every_fact_a_figure_needs():
    line = harness.machine_line(FACTS)
    assert line == ("CPU Made-up CPU 9000 (AVX2-only, no native bf16: bf16 emulated, 2 logical "
                    "CPUs, avx2, capped by ONEDNN_MAX_CPU_ISA=AVX2); torch 2.99, 2 threads")
    gpu = harness.machine_line({**FACTS, "instruction_caps": {}, "native_bf16": True,
                                "gpu": "NVIDIA H200"})
    assert "(AVX2-only, native bf16, 2 logical CPUs, avx2)" in gpu
    assert gpu.endswith("; GPU NVIDIA H200")
    facts = harness.machine_facts()  # this machine: the same keys, plain JSON values
    assert set(facts) == set(FACTS) and json.loads(json.dumps(facts)) == facts


# --------------------------------------------------------------------------- a baseline tree


def test_a_child_imports_the_baseline_trees_library_before_this_checkouts(tmp_path):
    """extract_tree unpacks HEAD's aiayn; a child started with child_env(tree) from any
    folder imports that copy, and bench from this checkout."""
    tree = harness.extract_tree("HEAD", tmp_path / "baseline")
    assert (tree / "aiayn" / "__init__.py").is_file() and not (tree / "bench").exists()
    probe = "import aiayn, bench.harness; print(aiayn.__file__); print(bench.harness.__file__)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path,
                          env=harness.child_env(tree), capture_output=True, text=True,
                          check=True)
    aiayn_file, harness_file = done.stdout.split()
    assert Path(aiayn_file) == tree / "aiayn" / "__init__.py"
    assert Path(harness_file) == REPO / "bench" / "harness.py"
    assert harness.module_command("bench.x", "--a") == [sys.executable, "-m", "bench.x", "--a"]


def test_a_child_on_a_tree_of_the_flat_layout_falls_back_to_its_module_names(tmp_path):
    """A baseline tree from before the package per concern has aiayn/tokenizer.py, not
    aiayn/data/: after import_from_tree, importing aiayn.data fails in the child (even under
    an editable install, whose finder would find this checkout's), so the workers' fallback
    imports the tree's own aiayn.tokenizer; aiayn.config comes from the tree too."""
    tree = tmp_path / "flat"
    (tree / "aiayn").mkdir(parents=True)
    for name in ("__init__", "tokenizer", "config"):
        (tree / "aiayn" / f"{name}.py").write_text(f"WHO = 'flat {name}'\n")
    probe = ("from bench import harness\n"
             "harness.import_from_tree()\n"
             "import aiayn.config\n"
             "try:\n"
             "    from aiayn.data import tokenizer\n"
             "except ImportError:\n"
             "    from aiayn import tokenizer\n"
             "print(aiayn.config.WHO, '|', getattr(tokenizer, 'WHO', tokenizer.__file__))\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path,
                          env=harness.child_env(tree), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "flat config | flat tokenizer"
    # A child of this checkout (no tree) is left as it is, and imports the new layout.
    env = harness.child_env()
    assert harness.TREE_ENV not in env
    probe = ("from bench import harness\n"
             "harness.import_from_tree()\n"
             "from aiayn.data import tokenizer\n"
             "print(tokenizer.__file__)\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == REPO / "aiayn" / "data" / "tokenizer.py"


def test_a_ref_git_does_not_know_stops_with_gits_message(tmp_path):
    with pytest.raises(SystemExit, match="--baseline no-such-ref: git archive failed: .+"):
        harness.extract_tree("no-such-ref", tmp_path / "baseline")


def test_rss_mib_is_the_resident_set_the_kernel_reports():
    """rss_mib() agrees with VmRSS of /proc/self/status (kB), read right after it."""
    if not Path("/proc/self/statm").exists():
        pytest.skip("no /proc on this system")
    ours = harness.rss_mib()
    status = Path("/proc/self/status").read_text()
    vm_rss_kib = int(next(line for line in status.splitlines()
                          if line.startswith("VmRSS:")).split()[1])
    assert ours == pytest.approx(vm_rss_kib / 1024, abs=2.0)
