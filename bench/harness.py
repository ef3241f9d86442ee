"""What the bench scripts share: argument checks (``parser``, ``require_positive``,
``int_list``), the machine facts a figure must name (``machine_facts``, ``machine_line``),
alternating rounds and per-round ratios (``rounds``, ``ratio``), the JSON record (``save``),
and child processes on a baseline commit's library (``extract_tree``, ``module_command``,
``child_env``).

The library is imported inside the functions that need it: a child process of
``bench.train_throughput`` imports this module with a baseline commit's ``aiayn`` first on
its path, and that may lack what the newest one has.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CPUINFO = Path("/proc/cpuinfo")


# =========================================================================== arguments


def parser(doc: str, epilog: bool = False) -> argparse.ArgumentParser:
    """A script's parser: the first paragraph of its docstring as the description (and,
    with ``epilog``, the rest after the options), laid out as written."""
    head, _, rest = doc.strip().partition("\n\n")
    main = getattr(sys.modules.get("__main__"), "__spec__", None)  # python -m bench.NAME
    ran = main.name if main and main.name.startswith("bench.") else None
    return argparse.ArgumentParser(prog=f"python -m {ran}" if ran else None,
                                   description=head,
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog=rest if epilog else None)


def require_positive(parser: argparse.ArgumentParser, args: argparse.Namespace,
                     *names: str) -> None:
    """argparse's usage error (exit 2) for the first of ``names`` (dests) that was given a
    value below 1; an option left at None is not checked."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} ({value}) must be at least 1")


def int_list(parser: argparse.ArgumentParser, option: str, text: str,
             what: str = "whole number") -> list[int]:
    """``text`` ("2,1") as whole numbers of at least 1, else argparse's usage error naming
    ``option``, ``what`` each number is, and the form to use."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        parser.error(f"{option} {text!r}: give {what}s separated by commas, e.g. 1,2")
    if min(values) < 1:
        parser.error(f"{option} {text!r}: each {what} must be at least 1")
    return values


# =========================================================================== machine facts

# A CPU's kind, from the first of these /proc/cpuinfo flags it has: what its bf16 and
# vector arithmetic can be (see aiayn.precision: bf16 is native on the first two, and on
# Arm with its BF16 feature; emulated, ~100x slower than fp32, elsewhere).
CPU_KINDS = (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX-512"),
             ("avx2", "AVX2-only"), ("bf16", "Arm BF16"), ("asimd", "Arm"))


def cpu_hardware_kind(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's kind (CPU_KINDS) from the flags of ``cpuinfo``; "unknown" without any: the
    hardware, whatever caps are in force (``aiayn.precision.cpu_kind`` says what a step
    computes in under them; ``instruction_caps`` in a record names the caps)."""
    from aiayn.precision import _cpuinfo_flags

    flags = _cpuinfo_flags(cpuinfo)
    return next((kind for flag, kind in CPU_KINDS if flag in flags), "unknown")


def machine_facts() -> dict:
    """What a figure must name about the machine it was taken on (plain JSON values)."""
    import torch

    from aiayn.precision import cpu_has_native_bf16, cpu_model, instruction_caps

    return {"cpu": cpu_model(), "cpu_kind": cpu_hardware_kind(),
            "native_bf16": cpu_has_native_bf16(), "instruction_caps": instruction_caps(),
            "logical_cpus": os.cpu_count(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def machine_line(facts: dict | None = None) -> str:
    """``facts`` (default: this machine's now) as a figure's header line."""
    f = facts or machine_facts()
    caps = " ".join(f"{k}={v}" for k, v in f["instruction_caps"].items())
    bf16 = "native bf16" if f["native_bf16"] else "no native bf16: bf16 emulated"
    line = (f"CPU {f['cpu']} ({f['cpu_kind']}, {bf16}, {f['logical_cpus']} logical CPUs, "
            f"{f['cpu_capability']}{', capped by ' + caps if caps else ''}); "
            f"torch {f['torch']}, {f['threads']} threads")
    return line + (f"; GPU {f['gpu']}" if f["gpu"] else "")


# =========================================================================== alternating rounds


def rounds(names: Sequence[str], n: int) -> Iterator[tuple[int, list[str]]]:
    """(round, the names in the order they take their turns in it) for ``n`` rounds; each
    round starts one further than the one before (A B C, B C A, C A B, A B C, ...; two
    contenders: A B, B A), so that each runs in every position as often."""
    names = list(names)
    for r in range(n):
        k = r % len(names)
        yield r, names[k:] + names[:k]


@dataclass(frozen=True)
class Ratio:
    """A ratio taken in each round (one machine state for both sides) and summarised: the
    median of the per-round ratios, and their range."""

    per_round: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.per_round)

    @property
    def low(self) -> float:
        return min(self.per_round)

    @property
    def high(self) -> float:
        return max(self.per_round)

    def __str__(self) -> str:
        return f"{self.median:.2f}x ({self.low:.2f}-{self.high:.2f})"


def ratio(numerators: Sequence[float], denominators: Sequence[float]) -> Ratio:
    """numerators[r] / denominators[r] for each round r (both measured in round r)."""
    return Ratio(tuple(a / b for a, b in zip(numerators, denominators, strict=True)))


# =========================================================================== the JSON record

RECORD_FIELDS = ("argv", "time", "machine")  # what ``record`` adds to a script's results


def record(results: dict, argv: Sequence[str] | None = None,
           machine: dict | None = None) -> dict:
    """``results`` with the fields every record carries: ``argv`` (the script's arguments;
    None: this process's), ``time`` (local, ISO 8601) and ``machine`` (``machine_facts()``
    unless the script gives its own, a superset)."""
    return {**results, "argv": list(sys.argv[1:] if argv is None else argv),
            "time": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": machine if machine is not None else machine_facts()}


def plain(value: Any) -> Any:
    """``value`` as standard JSON holds it: NaN as None (null), tuples as lists."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def write_json(path: Path, data: Any) -> None:
    """``data`` as standard JSON, whole or not at all (NaN written as null; values JSON has
    no type for, such as paths, as their text)."""
    from aiayn.io import write_text

    write_text(path, json.dumps(plain(data), indent=2, default=str, allow_nan=False) + "\n")


def save(results: dict, path: Path | None, argv: Sequence[str] | None = None,
         machine: dict | None = None) -> dict:
    """The record of ``results`` (``record``), written to ``path`` when one is given."""
    out = record(results, argv, machine)
    if path is not None:
        write_json(path, out)
        print(f"wrote {path}")
    return out


def command_line(module: str, argv: Sequence[str] | None = None) -> str:
    """The command that runs ``module`` with ``argv`` (None: this process's) again."""
    return shlex.join([sys.executable, "-m", module,
                       *(sys.argv[1:] if argv is None else argv)])


# =========================================================================== child processes


def extract_tree(ref: str, dest: Path, paths: Sequence[str] = ("aiayn",)) -> Path:
    """The ``paths`` (the library) of git commit ``ref`` of this repository, unpacked under
    ``dest``; a ref git does not know stops the run with git's message."""
    dest.mkdir(parents=True, exist_ok=True)
    try:
        archive = subprocess.run(["git", "archive", ref, *paths], cwd=REPO, check=True,
                                 capture_output=True).stdout
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"error: --baseline {ref}: git archive failed: "
                         f"{exc.stderr.decode().strip()}") from None
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def train_stage_args(params: Path, run: Path, *, shards: Path, tokenizer: Path,
                     raw: Path) -> list[str]:
    """The flags of ``python -m stages.train`` (``aiayn train``) that read a workspace's
    ``shards``, ``tokenizer`` and ``raw`` text and write every output of the run under
    ``run``, with the progress bar and MLflow off: a training started apart from DVC, as
    the benchmarks and the tests start one."""
    return ["--params", str(params), "--shards", str(shards), "--tokenizer", str(tokenizer),
            "--raw", str(raw), "--checkpoints", str(run / "checkpoints"),
            "--metrics", str(run / "train.json"), "--train-log", str(run / "train_log.tsv"),
            "--valid-log", str(run / "valid_log.tsv"), "--curves", str(run / "curves.png"),
            "--no-progress", "--no-mlflow"]


def rss_mib() -> float | None:
    """This process's resident memory in MiB (/proc/self/statm), or None where there is no
    /proc to read it from."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return None


def module_command(module: str, *args: str) -> list[str]:
    """The argv that runs bench script ``module`` in a child process of this Python."""
    return [sys.executable, "-m", module, *args]


TREE_ENV = "AIAYN_BENCH_TREE"


def child_env(*first: str | Path) -> dict[str, str]:
    """This process's environment for a child process that runs a bench script from any
    folder: the repository on its import path, after ``first`` (e.g. a baseline commit's
    tree from ``extract_tree``, whose ``aiayn`` then comes before this checkout's; the
    child calls ``import_from_tree`` to keep it that way)."""
    paths = [*map(str, first), str(REPO)]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    env.pop(TREE_ENV, None)
    if first:
        env[TREE_ENV] = str(first[0])
    return env


def import_from_tree() -> None:
    """In a child process started on a baseline tree (``child_env(tree)``): import aiayn's
    modules from that tree alone. An editable install (``pip install -e``, as ``make``
    installs) adds an import finder that finds aiayn's subpackages in this checkout
    whatever folder aiayn itself came from, so a package the baseline lacks (``aiayn.data``
    in a tree of the flat layout) would load from this checkout instead of raising the
    ImportError on which the workers fall back to the baseline's own module names."""
    if not os.environ.get(TREE_ENV):
        return
    sys.meta_path[:] = [finder for finder in sys.meta_path
                        if not (getattr(finder, "__module__", None)
                                or type(finder).__module__).startswith("__editable__")]
