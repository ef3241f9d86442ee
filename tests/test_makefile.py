"""`make install` survives a download cut short: pip is tried again, and a failure that lasts
still fails the build with nothing marked installed."""

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Stands in for the venv's python: `import torch` succeeds, and `pip install` fails until the
# counter reaches SUCCEED_ON (0: never), the way a cut-short download fails.
FAKE_PYTHON = """#!/bin/sh
case "$*" in *"import torch"*) exit 0;; esac
n=$(cat "$(dirname "$0")/../pip_calls" 2>/dev/null || echo 0); n=$((n+1))
echo $n > "$(dirname "$0")/../pip_calls"
echo "pip call $n: $*"
[ "$SUCCEED_ON" -ne 0 ] && [ $n -ge "$SUCCEED_ON" ]
"""


def make_install(tmp_path: Path, succeed_on: int, tries: int):
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    proc = subprocess.run(
        ["make", "-s", "-C", str(ROOT), f"VENV={venv}", "PIP_SLEEP=0", f"PIP_TRIES={tries}",
         f"{venv}/.installed"],
        capture_output=True, text=True, env={**os.environ, "SUCCEED_ON": str(succeed_on)},
    )
    calls = int((venv / "pip_calls").read_text()) if (venv / "pip_calls").exists() else 0
    return proc, calls, (venv / ".installed").exists()


def test_install_tries_pip_again_after_a_failed_download(tmp_path):
    proc, calls, installed = make_install(tmp_path, succeed_on=3, tries=3)
    assert proc.returncode == 0, proc.stderr
    assert calls == 3 and installed
    assert proc.stderr.count("pip install failed") == 2
    assert '.[dev,export]' in proc.stdout


def test_install_fails_and_marks_nothing_when_every_try_fails(tmp_path):
    proc, calls, installed = make_install(tmp_path, succeed_on=0, tries=2)
    assert proc.returncode != 0
    assert calls == 2 and not installed
    assert "try 2 of 2" in proc.stderr
