"""DVC experiments as DVC's Python API lists them, with their files as their commits hold them.

:func:`read` asks ``dvc.api.exp_show`` for the experiments of HEAD (or of every commit) and
gives each its name, commit and state; for a finished experiment it also reads the files
asked for (params.yaml, metrics/*.json) from its commit with ``git show REV:PATH``. Table 3
(``aiayn table3``, ``aiayn results --table3``) and ``bench/sweep_table.py`` read experiments
here and nowhere else.

Why the files and not exp_show's own cells: exp_show flattens them into text cells that it
then turns into floats where it can (a d_model of 512 comes back as 512.0, a list or a
boolean as text). Why ``git show``: it is an order of magnitude faster than
``dvc.api.params_show`` / ``metrics_show(rev=...)``, which also merge the metrics files into
one dict, renaming the keys that two files share.

The state is DVC's: Queued, Running, Failed (a failed or killed run) or Success (a finished
run; DVC gives none once the executor is gone). DVC lists an unfinished experiment with its
baseline commit's metrics (seen: a killed or running row showed the demo's), so only a
finished one is read. A finished one whose commit DVC could not read (no creation time, or
``!`` in a cell: a file it could not read) counts as Failed.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from aiayn.errors import AiaynError

STATES = ("Queued", "Running", "Failed", "Success")
WORKSPACE = "workspace"

Read = Callable[[str, str], bytes | None]  # (rev, path) -> the file's bytes, None: not there


@dataclass(frozen=True)
class Experiment:
    """One row of ``dvc.api.exp_show``: an experiment, or a baseline (a commit, or the
    workspace) that experiments start from."""

    name: str  # the experiment's name; a baseline's: its rev
    rev: str  # its commit's first 7 hex digits, as DVC shows it; "workspace"
    state: str  # one of STATES; a baseline: Success
    baseline: bool = False
    # The files asked for, parsed, as the commit holds them (a baseline: its commit, or the
    # working tree); empty unless finished, and without those the commit lacks.
    files: dict[str, Any] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.state == "Success"


def listed(rows: list[dict]) -> list[Experiment]:
    """``dvc.api.exp_show``'s rows as experiments, in its order (a baseline, then its
    experiments: running, finished, queued and failed ones, each newest first); no files."""
    out = []
    for row in rows:
        rev, baseline = str(row["rev"]), row.get("typ") == "baseline"
        state = row.get("State") or "Success"
        if state == "Success" and not baseline and (
                row.get("Created") is None or "!" in row.values()):
            state = "Failed"  # DVC could not read the commit, or one of its files
        out.append(Experiment(rev if baseline else row.get("Experiment") or rev, rev, state,
                              baseline))
    return out


def states(experiments: Iterable[Experiment]) -> dict[str, str]:
    """Each experiment's state by name (baselines left out); of two with one name, the first
    (DVC lists a finished one before a queued or failed one, each kind newest first)."""
    found: dict[str, str] = {}
    for exp in experiments:
        if not exp.baseline:
            found.setdefault(exp.name, exp.state)
    return found


def read(files: Iterable[str] = (), *, all_commits: bool = False,
         rows: list[dict] | None = None, read_file: Read | None = None) -> list[Experiment]:
    """The experiments of HEAD (``all_commits``: of every commit, as `dvc exp show -A`), each
    finished one and each baseline with ``files`` (paths in the repository; .yaml and .json
    parsed). ``rows`` and ``read_file`` stand in for exp_show and ``git show`` (tests)."""
    root = None
    if rows is None:
        root = dvc_root()
        rows = exp_show(root, all_commits)
    if read_file is None:
        root = root or dvc_root()
        read_file = lambda rev, path: git_file(rev, path, root)  # noqa: E731
    files = tuple(files)
    return [replace(exp, files=_files(exp, files, read_file, root))
            if files and exp.finished else exp for exp in listed(rows)]


def _files(exp: Experiment, files: tuple[str, ...], read_file: Read,
           root: Path | None) -> dict[str, Any]:
    out = {}
    for path in files:
        if exp.rev == WORKSPACE and exp.baseline:
            local = (root or Path()) / path
            data = local.read_bytes() if local.is_file() else None
        else:
            data = read_file(exp.rev, path)
        if data is None:
            continue
        try:
            out[path] = (yaml.safe_load(data) if path.endswith((".yaml", ".yml"))
                         else json.loads(data))
        except (ValueError, yaml.YAMLError) as exc:
            raise AiaynError(f"{exp.name} (commit {exp.rev}): {path} does not parse: "
                             f"{' '.join(str(exc).split())[:200]}") from None
    return out


def dvc_root() -> Path:
    """The DVC repository holding the current directory."""
    try:
        from dvc.exceptions import NotDvcRepoError
        from dvc.repo import Repo
    except ImportError:
        raise AiaynError("DVC is not installed in this Python: activate the project's "
                         "virtualenv (source .venv/bin/activate) or pip install dvc") from None
    try:
        return Path(Repo.find_root())
    except NotDvcRepoError:
        raise AiaynError(f"{Path.cwd()}: not inside a DVC repository; run this from the "
                         "project's root (a git repository where `dvc init` was run)") from None


def exp_show(root: Path, all_commits: bool = False) -> list[dict]:
    """``dvc.api.exp_show``'s rows for the repository at ``root``: HEAD and its experiments,
    or (``all_commits``) every commit of HEAD, the branches, tags and remotes and theirs;
    the workspace first. A baseline's rev is its commit's (DVC shows a branch's name)."""
    import dvc.api
    from dvc.exceptions import DvcException

    revs = None
    if all_commits:
        # As `dvc exp show -A` lists them: HEAD first, then the others newest first.
        revs = ["HEAD", *_git(["rev-list", "HEAD", "--branches", "--tags", "--remotes"],
                              root).split()]
    try:
        rows = dvc.api.exp_show(repo=str(root), revs=revs)
    except DvcException as exc:
        raise AiaynError(f"DVC could not list the experiments of {root}: {exc}") from None
    # DVC shows a baseline by its branch or tag where it has one: its commit instead.
    named = [row for row in rows if row["typ"] == "baseline" and row["rev"] != WORKSPACE]
    if named:
        commits = _git(["rev-parse", *(f"{row['rev']}^{{commit}}" for row in named)], root)
        for row, commit in zip(named, commits.split(), strict=True):
            row["rev"] = commit[:7]
    return rows


def git_file(rev: str, path: str, root: Path | str = ".") -> bytes | None:
    """``path`` (relative to ``root``) as commit ``rev`` holds it; None where it has none."""
    shown = _run(["show", f"{rev}:./{path}"], root)
    return shown.stdout if shown.returncode == 0 else None


def _git(args: list[str], root: Path | str) -> str:
    done = _run(args, root)
    if done.returncode != 0:
        raise AiaynError(f"git {' '.join(args[:2])} ... in {root} failed: "
                         f"{' '.join(done.stderr.decode(errors='replace').split())[:300]}")
    return done.stdout.decode()


def _run(args: list[str], root: Path | str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True)
    except FileNotFoundError:
        raise AiaynError("git: command not found; DVC experiments are git commits, and "
                         "reading them needs git on PATH") from None
