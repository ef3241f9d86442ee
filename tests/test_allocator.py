"""train.allocator: which C heap CPU training runs on, and `aiayn train` re-launching itself
with it preloaded (aiayn.training.memory, stages.train)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aiayn.errors import AiaynError
from aiayn.training import memory
from stages import train as train_stage
from tests.conftest import REPO, write_params

INSTALLED = {name: memory.allocator_library(name) for name in memory.ALLOCATORS}


def installed(*names: str):
    """allocator_library answering as if only ``names`` were installed."""
    return lambda name: f"lib{name}.so.test" if name in names else None


@pytest.mark.parametrize(("present", "on_cpu", "expected"), [
    (("tcmalloc", "jemalloc"), True, "tcmalloc"),
    (("jemalloc",), True, "jemalloc"),
    ((), True, "glibc"),
    (("tcmalloc", "jemalloc"), False, "glibc"),  # a GPU's steps are not bound by the heap
])
def test_auto_takes_the_first_installed_allocator_on_a_cpu_only(monkeypatch, present, on_cpu,
                                                                 expected):
    monkeypatch.setattr(memory, "allocator_library", installed(*present))
    assert memory.choose_allocator("auto", on_cpu) == expected


def test_a_named_allocator_is_kept_or_refused_with_the_package_to_install(monkeypatch):
    monkeypatch.setattr(memory, "allocator_library", installed("jemalloc"))
    assert memory.choose_allocator("jemalloc", on_cpu=False) == "jemalloc"
    assert memory.choose_allocator("glibc", on_cpu=True) == "glibc"
    with pytest.raises(FileNotFoundError, match="train.allocator is tcmalloc.*apt install "
                                                "libtcmalloc-minimal4"):
        memory.choose_allocator("tcmalloc", on_cpu=True)


def test_the_child_environment_preloads_the_library_first_and_keeps_what_was_set(monkeypatch):
    monkeypatch.setattr(memory, "allocator_library", installed("jemalloc"))
    env = memory.allocator_env("jemalloc", {"LD_PRELOAD": "libother.so", "PATH": "/bin"})
    assert env["LD_PRELOAD"] == "libjemalloc.so.test libother.so"
    assert env["MALLOC_CONF"] == memory.ALLOCATOR_ENV["jemalloc"]["MALLOC_CONF"]
    assert env["PATH"] == "/bin"
    mine = memory.allocator_env("jemalloc", {"MALLOC_CONF": "narenas:1"})
    assert mine["MALLOC_CONF"] == "narenas:1" and mine["LD_PRELOAD"] == "libjemalloc.so.test"
    with pytest.raises(FileNotFoundError, match="no tcmalloc library"):
        memory.allocator_env("tcmalloc", {})


def test_a_child_environment_holds_one_allocator_at_most(monkeypatch):
    """Switching heaps replaces the preloaded one; glibc preloads none; other preloaded
    libraries stay, in order."""
    monkeypatch.setattr(memory, "allocator_library", installed("jemalloc", "tcmalloc"))
    parent = {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2:libother.so", "PATH": "/bin"}
    tc = memory.allocator_env("tcmalloc", parent)
    assert tc["LD_PRELOAD"] == "libtcmalloc.so.test libother.so"
    glibc = memory.allocator_env("glibc", parent)
    assert glibc["LD_PRELOAD"] == "libother.so" and "MALLOC_CONF" not in glibc
    assert "LD_PRELOAD" not in memory.allocator_env("glibc", {"LD_PRELOAD": "libjemalloc.so.2"})
    assert parent["LD_PRELOAD"] == "/usr/lib/libjemalloc.so.2:libother.so"  # not changed


def test_every_allocator_names_its_package_and_the_messages_use_it():
    assert set(memory.PACKAGES) == set(memory.ALLOCATORS)
    assert memory.install_hint("jemalloc") == "`apt install libjemalloc2`"
    assert memory.install_hint() == "`apt install libtcmalloc-minimal4 libjemalloc2`"


@pytest.mark.parametrize("text,name", [
    ("libtcmalloc_minimal.so.4", "tcmalloc"),
    ("/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4", "tcmalloc"),
    ("libjemalloc.so.2", "jemalloc"),
    ("7f0-7f1 r-xp 00000000 08:01 42 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n", "jemalloc"),
    ("/usr/lib/x86_64-linux-gnu/libc.so.6", None),
    ("libmimalloc.so.2", None),
])
def test_a_library_name_or_memory_map_names_its_allocator(text, name):
    """One rule for both uses: LD_PRELOAD's entries (allocator_env) and /proc/PID/maps
    (loaded_allocator)."""
    assert memory.library_allocator(text) == name


def test_another_process_s_allocator_is_read_from_its_memory_map(monkeypatch):
    """loaded_allocator(pid) reads /proc/PID/maps: a child on glibc reads glibc, one on an
    installed allocator reads that one (where installed), a gone process reads glibc."""
    wait = [sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"]
    children = {"glibc": memory.allocator_env("glibc")}
    children.update({name: memory.allocator_env(name) for name in INSTALLED if INSTALLED[name]})
    for name, env in children.items():
        proc = subprocess.Popen(wait, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                text=True)
        try:
            assert proc.stdout.readline() == "up\n"  # running: its libraries are mapped
            assert memory.loaded_allocator(proc.pid) == name
        finally:
            proc.communicate("")
    assert memory.loaded_allocator(proc.pid) == "glibc"  # reaped: no maps to read


@pytest.mark.parametrize("name", sorted(memory.ALLOCATORS))
def test_a_child_started_with_the_environment_runs_on_that_allocator(name):
    if not INSTALLED[name]:
        pytest.skip(f"{name} is not installed here")
    probe = "from aiayn.training.memory import loaded_allocator; print(loaded_allocator())"
    env = memory.allocator_env(name, dict(os.environ, PYTHONPATH=str(REPO)))
    ran = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, check=True)
    assert ran.stdout.strip() == name
    plain = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           check=True, env=dict(os.environ, PYTHONPATH=str(REPO),
                                                LD_PRELOAD=""))
    assert plain.stdout.strip() == "glibc"


class Exec(Exception):
    """os.execve, caught instead of replacing the test process."""


@pytest.fixture
def fake_exec(monkeypatch):
    calls = []

    def execve(path, args, env):
        calls.append((path, args, env))
        raise Exec

    monkeypatch.setattr(train_stage.os, "execve", execve)
    monkeypatch.delenv(train_stage.ALLOCATOR_RELAUNCHED, raising=False)
    return calls


def params(tmp_path: Path, allocator: str, device: str = "cpu"):
    from aiayn.config import load_params

    return load_params(write_params(tmp_path / "params.yaml",
                                    {"train": {"allocator": allocator, "device": device}}))


def test_the_train_command_re_launches_itself_on_the_chosen_allocator(monkeypatch, tmp_path,
                                                                      fake_exec):
    monkeypatch.setattr(memory, "allocator_library", installed("tcmalloc"))
    monkeypatch.setattr(memory, "loaded_allocator", lambda: "glibc")
    monkeypatch.setattr(train_stage, "launched_as_command", lambda: True)
    monkeypatch.setattr(sys, "orig_argv", ["python3", "-m", "stages.train", "--no-mlflow"])
    with pytest.raises(Exec):
        train_stage.relaunch_with_allocator(params(tmp_path, "auto"))
    (path, args, env), = fake_exec
    assert path == sys.executable and args == [sys.executable, "-m", "stages.train",
                                               "--no-mlflow"]
    assert env["LD_PRELOAD"].split()[0] == "libtcmalloc.so.test"
    assert env[train_stage.ALLOCATOR_RELAUNCHED] == "tcmalloc"


@pytest.mark.parametrize("case", ["loaded already", "glibc chosen", "tried once", "from python"])
def test_no_re_launch_where_it_has_nothing_to_do_or_must_not(monkeypatch, tmp_path, fake_exec,
                                                             case):
    monkeypatch.setattr(memory, "allocator_library", installed("tcmalloc"))
    monkeypatch.setattr(memory, "loaded_allocator",
                        lambda: "tcmalloc" if case == "loaded already" else "glibc")
    monkeypatch.setattr(train_stage, "launched_as_command", lambda: case != "from python")
    if case == "tried once":
        monkeypatch.setenv(train_stage.ALLOCATOR_RELAUNCHED, "tcmalloc")
    choice = "glibc" if case == "glibc chosen" else "auto"
    train_stage.relaunch_with_allocator(params(tmp_path, choice))
    assert fake_exec == []


def test_a_named_allocator_that_is_not_installed_stops_the_stage(monkeypatch, tmp_path,
                                                                 fake_exec):
    monkeypatch.setattr(memory, "allocator_library", installed())
    with pytest.raises(AiaynError, match="train.allocator is jemalloc.*libjemalloc2"):
        train_stage.relaunch_with_allocator(params(tmp_path, "jemalloc"))
    assert fake_exec == []


def test_only_the_command_line_of_the_train_stage_counts_as_launched(monkeypatch):
    assert not train_stage.launched_as_command()  # pytest's own command line
    monkeypatch.setattr(sys, "argv", ["/venv/bin/aiayn", "train", "--no-mlflow"])
    assert train_stage.launched_as_command()
    monkeypatch.setattr(sys, "argv", ["/venv/bin/aiayn", "average"])
    assert not train_stage.launched_as_command()
    monkeypatch.setattr(sys, "argv", [train_stage.__file__, "--no-mlflow"])  # python -m
    assert train_stage.launched_as_command()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(memory.ALLOCATORS))
def test_aiayn_train_runs_on_the_allocator_it_names_and_records_it(toy_workspace, tmp_path,
                                                                   name):
    if not INSTALLED[name]:
        pytest.skip(f"{name} is not installed here")
    from tests.test_training import env_for_subprocess, train_cmd

    p = write_params(tmp_path / "params.yaml",
                     {"train": {"allocator": name, "device": "cpu", "steps": 4}})
    env = {k: v for k, v in env_for_subprocess().items() if k != "LD_PRELOAD"}
    ran = subprocess.run([sys.executable, "-m", "stages.train",
                          *train_cmd(p, tmp_path / "run", toy_workspace)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert f"re-launching on {name}" in ran.stderr
    summary = json.loads((tmp_path / "run/train.json").read_text())
    assert summary["allocator"] == name and summary["steps"] == 4


def test_auto_on_glibc_tells_how_to_get_the_faster_allocator(monkeypatch, tmp_path, fake_exec,
                                                             caplog):
    monkeypatch.setattr(memory, "allocator_library", installed())
    monkeypatch.setattr(memory, "loaded_allocator", lambda: "glibc")
    with caplog.at_level("INFO"):
        train_stage.relaunch_with_allocator(params(tmp_path, "auto"))
    assert "apt install libtcmalloc-minimal4" in caplog.text
    assert fake_exec == []
    caplog.clear()
    with caplog.at_level("INFO"):  # not where glibc was asked for, nor on a GPU
        train_stage.relaunch_with_allocator(params(tmp_path, "glibc"))
        monkeypatch.setattr("torch.cuda.is_available", lambda: True)
        train_stage.relaunch_with_allocator(params(tmp_path, "auto", device="auto"))
    assert "apt install" not in caplog.text


def test_torchrun_re_launches_the_command_only(monkeypatch, fake_exec):
    """train.nproc_per_node > 1: `aiayn train` replaces itself by torchrun running it; a
    script that calls the stage function is not replaced by torchrun running the script's
    own command line, but told how to run it."""
    monkeypatch.setattr(train_stage, "launched_as_command", lambda: False)
    with pytest.raises(AiaynError, match="called from Python.*torchrun --nproc-per-node 2"):
        train_stage.relaunch_under_torchrun(2, 0)
    assert fake_exec == []
    monkeypatch.setattr(train_stage, "launched_as_command", lambda: True)
    monkeypatch.setattr(sys, "argv", ["/venv/bin/aiayn", "train", "--no-mlflow"])
    with pytest.raises(Exec):
        train_stage.relaunch_under_torchrun(2, 0)
    (path, args, env), = fake_exec
    assert args[1:] == ["--standalone", "--nproc-per-node=2", "--max-restarts=0", "-m",
                        "stages.train", "--no-mlflow"]
