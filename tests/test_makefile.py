"""`make install`: the torch build it picks (TORCH_BUILD, TORCH), and that it survives a download
cut short: pip is tried again, and a failure that lasts still fails the build with nothing
marked installed. Nothing is downloaded: a fake venv python records the pip calls."""

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VERSION = "2.13.0"  # TORCH_VERSION in the Makefile
INDEX = "https://download.pytorch.org/whl"

# Stands in for the venv's python. `import torch` prints $TORCH_FOUND (torch's version and
# build) or fails where it is empty. Every pip call is logged, one line each, in pip_calls; it
# fails until the count reaches SUCCEED_ON (0: never), the way a cut-short download fails.
# With NO_LOCAL_TORCH set, a torch install without --index-url fails, as where pip has no such
# build of its own (no local wheel, PyPI has no +cpu or +cu wheels).
FAKE_PYTHON = """#!/bin/sh
case "$*" in *"import torch"*) [ -n "$TORCH_FOUND" ] && echo "$TORCH_FOUND" && exit 0; exit 1;; esac
log="$(dirname "$0")/../pip_calls"
echo "$*" >> "$log"
n=$(($(wc -l < "$log")))
echo "pip call $n: $*"
case "$*" in *--index-url*) ;; *" torch"*) [ -n "$NO_LOCAL_TORCH" ] && exit 1;; esac
[ "$SUCCEED_ON" -ne 0 ] && [ $n -ge "$SUCCEED_ON" ]
"""
FAKE_NVIDIA_SMI_GPU = """#!/bin/sh
echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-0000-0000-0000-000000000000)"
"""
FAKE_NVIDIA_SMI_NO_DRIVER = """#!/bin/sh
echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
exit 9
"""
FAKE_UNAME_MACOS = """#!/bin/sh
case "$1" in -s) echo Darwin;; -m) echo arm64;; *) echo Darwin;; esac
"""
FAKE_UNAME_AARCH64 = """#!/bin/sh
case "$1" in -s) echo Linux;; -m) echo aarch64;; *) echo Linux;; esac
"""
# What the recipes call besides the venv's python; PATH holds these and nothing else, so that
# the machine's own nvidia-smi (or its lack) does not count.
TOOLS = ["uname", "grep", "seq", "sleep", "touch", "test", "cat", "dirname", "wc", "tail"]


def script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def make_install(tmp_path: Path, succeed_on: int = 1, tries: int = 3, torch_found: str = "",
                 make_vars=(), fake_tools=None, no_local_torch: bool = False):
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    script(venv / "bin" / "python", FAKE_PYTHON)
    tools = tmp_path / "tools"
    tools.mkdir()
    for name in TOOLS:
        if (found := shutil.which(name)) is not None:
            (tools / name).symlink_to(found)
    for name, text in (fake_tools or {}).items():
        (tools / name).unlink(missing_ok=True)
        script(tools / name, text)
    env = {**os.environ, "PATH": str(tools), "SUCCEED_ON": str(succeed_on),
           "TORCH_FOUND": torch_found, "NO_LOCAL_TORCH": "1" if no_local_torch else ""}
    for name in ("TORCH", "TORCH_BUILD", "TORCH_VERSION", "TORCH_BUILDS", "TORCH_INDEX"):
        env.pop(name, None)
    proc = subprocess.run(
        [make, "-s", "-C", str(ROOT), f"VENV={venv}", "PIP_SLEEP=0", f"PIP_TRIES={tries}",
         *make_vars, f"{venv}/.installed"],
        capture_output=True, text=True, env=env,
    )
    log = venv / "pip_calls"
    calls = log.read_text().splitlines() if log.exists() else []
    return proc, calls, (venv / ".installed").exists()


def torch_calls(calls):
    return [c for c in calls if ".[dev,export]" not in c]


def test_install_tries_pip_again_after_a_failed_download(tmp_path):
    proc, calls, installed = make_install(tmp_path, succeed_on=3, tries=3,
                                          torch_found="2.13.0+cpu (CPU only)")
    assert proc.returncode == 0, proc.stderr
    assert len(calls) == 3 and installed
    assert proc.stderr.count("pip install failed") == 2
    assert '.[dev,export]' in proc.stdout


def test_install_fails_and_marks_nothing_when_every_try_fails(tmp_path):
    proc, calls, installed = make_install(tmp_path, succeed_on=0, tries=2,
                                          torch_found="2.13.0+cpu (CPU only)")
    assert proc.returncode != 0
    assert len(calls) == 2 and not installed
    assert "try 2 of 2" in proc.stderr


def test_torch_already_in_the_venv_is_left_as_it_is_and_named(tmp_path):
    proc, calls, installed = make_install(
        tmp_path, torch_found="2.13.0 (CUDA 13.0)", make_vars=["TORCH_BUILD=cpu"])
    assert proc.returncode == 0, proc.stderr
    assert torch_calls(calls) == [] and installed
    assert "has torch 2.13.0 (CUDA 13.0): left as it is" in proc.stdout


def test_cpu_build_comes_from_the_cpu_index_where_pip_has_none_of_its_own(tmp_path):
    proc, calls, installed = make_install(tmp_path, make_vars=["TORCH_BUILD=cpu"],
                                          no_local_torch=True)
    assert proc.returncode == 0, proc.stderr
    assert installed
    first, second = torch_calls(calls)
    # pip's own sources first (a local wheel, a mirror), then the PyTorch index.
    assert first.endswith(f"install --retries 10 --timeout 60 torch=={VERSION}+cpu")
    assert f"--index-url {INDEX}/cpu torch=={VERSION}+cpu" in second
    assert calls[-1].endswith('-e .[dev,export]')


def test_cpu_build_pip_finds_itself_needs_no_index(tmp_path):
    # This machine and CI: pip.conf's find-links holds the +cpu wheel, and the PyTorch index
    # is out of reach (pip would retry it for minutes).
    proc, calls, installed = make_install(tmp_path, make_vars=["TORCH_BUILD=cpu"])
    assert proc.returncode == 0, proc.stderr
    assert installed
    assert torch_calls(calls) == [f"-m pip install --retries 10 --timeout 60 torch=={VERSION}+cpu"]
    assert not any("--index-url" in c for c in calls)


def test_the_index_install_is_tried_again_after_a_failed_download(tmp_path):
    # call 1: pip's own sources (none), 2: the index, cut short, 3: the index, 4: the project
    proc, calls, installed = make_install(tmp_path, succeed_on=3, tries=3,
                                          make_vars=["TORCH_BUILD=cpu"], no_local_torch=True)
    assert proc.returncode == 0, proc.stderr
    assert len(calls) == 4 and installed
    assert [("--index-url" in c) for c in calls] == [False, True, True, False]
    assert proc.stderr.count("pip install failed") == 1


def test_a_named_cuda_build_comes_from_its_index(tmp_path):
    proc, calls, installed = make_install(tmp_path, make_vars=["TORCH_BUILD=cu126"],
                                          no_local_torch=True)
    assert proc.returncode == 0, proc.stderr
    assert installed
    assert f"--index-url {INDEX}/cu126 torch=={VERSION}+cu126" in torch_calls(calls)[-1]


def test_the_version_is_one_variable(tmp_path):
    proc, calls, installed = make_install(
        tmp_path, make_vars=["TORCH_BUILD=cu130", "TORCH_VERSION=2.13.1"], no_local_torch=True)
    assert proc.returncode == 0, proc.stderr
    assert f"--index-url {INDEX}/cu130 torch==2.13.1+cu130" in torch_calls(calls)[-1]


def test_auto_picks_cpu_without_nvidia_smi(tmp_path):
    proc, calls, installed = make_install(tmp_path, no_local_torch=True)
    assert proc.returncode == 0, proc.stderr
    assert installed
    assert "no GPU listed by nvidia-smi" in proc.stdout
    assert f"--index-url {INDEX}/cpu torch=={VERSION}+cpu" in torch_calls(calls)[-1]


def test_auto_picks_cpu_where_nvidia_smi_finds_no_gpu(tmp_path):
    proc, calls, installed = make_install(
        tmp_path, fake_tools={"nvidia-smi": FAKE_NVIDIA_SMI_NO_DRIVER}, no_local_torch=True)
    assert proc.returncode == 0, proc.stderr
    assert f"torch=={VERSION}+cpu" in torch_calls(calls)[-1]


def test_auto_picks_pypis_cuda_build_with_a_gpu(tmp_path):
    proc, calls, installed = make_install(tmp_path, fake_tools={"nvidia-smi": FAKE_NVIDIA_SMI_GPU})
    assert proc.returncode == 0, proc.stderr
    assert installed
    assert "nvidia-smi lists a GPU" in proc.stdout
    # PyPI's torch for Linux x86_64 is the CUDA build: no index, no local version.
    assert torch_calls(calls) == [f"-m pip install --retries 10 --timeout 60 torch=={VERSION}"]


def test_auto_on_macos_is_pypis_torch(tmp_path):
    proc, calls, installed = make_install(
        tmp_path, fake_tools={"uname": FAKE_UNAME_MACOS, "nvidia-smi": FAKE_NVIDIA_SMI_GPU})
    assert proc.returncode == 0, proc.stderr
    assert torch_calls(calls) == [f"-m pip install --retries 10 --timeout 60 torch=={VERSION}"]


@pytest.mark.parametrize("build", ["auto", "cpu"])
def test_cpu_on_linux_aarch64_comes_from_the_cpu_index_untagged(tmp_path, build):
    # Its wheels on download.pytorch.org/whl/cpu may lack the +cpu tag, and PyPI's may be CUDA.
    proc, calls, installed = make_install(
        tmp_path, make_vars=[f"TORCH_BUILD={build}"], fake_tools={"uname": FAKE_UNAME_AARCH64})
    assert proc.returncode == 0, proc.stderr
    assert torch_calls(calls) == [
        f"-m pip install --retries 10 --timeout 60 --index-url {INDEX}/cpu torch=={VERSION}"]


def test_a_cuda_build_on_macos_fails_and_marks_nothing(tmp_path):
    proc, calls, installed = make_install(
        tmp_path, make_vars=["TORCH_BUILD=cu130"], fake_tools={"uname": FAKE_UNAME_MACOS})
    assert proc.returncode != 0
    assert calls == [] and not installed
    assert "TORCH_BUILD=cu130" in proc.stderr and "macOS" in proc.stderr


def test_torch_overrides_the_build(tmp_path):
    proc, calls, installed = make_install(
        tmp_path, make_vars=["TORCH=torch==2.5.1", "TORCH_BUILD=cu126"],
        fake_tools={"nvidia-smi": FAKE_NVIDIA_SMI_GPU})
    assert proc.returncode == 0, proc.stderr
    assert installed
    assert torch_calls(calls) == ["-m pip install --retries 10 --timeout 60 torch==2.5.1"]


@pytest.mark.parametrize("build", ["cu128", "gpu", "cpu cu126", ""])
def test_an_unknown_build_fails_naming_the_choices_and_marks_nothing(tmp_path, build):
    proc, calls, installed = make_install(tmp_path, make_vars=[f"TORCH_BUILD={build}"])
    assert proc.returncode != 0
    assert calls == [] and not installed
    assert f"TORCH_BUILD='{build}'" in proc.stderr
    assert "auto cpu cu126 cu130 cu132" in proc.stderr


def test_help_names_the_torch_builds():
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    out = subprocess.run(["make", "-s", "-C", str(ROOT), "help"], capture_output=True,
                         text=True, check=True).stdout
    assert "TORCH_BUILD=cpu" in out and "cu126 cu130" in out and "TORCH=" in out


def test_the_demo_ends_by_checking_that_it_learned():
    """`make demo` fails below sacreBLEU 60 (the preset reaches ~86-89): the demo's learning
    is checked where the demo runs, `make demo`, and CI runs it after the tests."""
    env = {k: v for k, v in os.environ.items()  # as typed, not under `make test`'s make
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    dry = subprocess.run(["make", "--no-print-directory", "-n", "demo"], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert dry[-3:] == ["dvc repro", "echo", "aiayn results --min-bleu 60"], dry
    ci = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    assert ci.index("make test") < ci.index("make demo"), ci
