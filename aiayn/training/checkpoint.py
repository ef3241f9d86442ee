"""Crash-proof training checkpoints, checkpoint averaging and the exported model folder.

A checkpoint is one ``torch.save`` file ``step-00001200.pt`` holding a plain dict (model and
optimizer state dicts, step, RNG states as uint8 tensors, a data cursor, a ``meta`` dict):
only tensors, numbers, strings, ``None`` and lists/tuples/dicts of them, so that every load
can use ``torch.load(..., weights_only=True)``, which runs no pickled code.

Each file is written to a temporary sibling, flushed to disk and renamed into place, so a
killed trainer leaves either the complete new checkpoint or none; after the write the
oldest files beyond ``keep`` are deleted. Should a file still be unreadable (a disk error,
a copy cut short), :func:`latest_checkpoint` falls back to the previous one.

Section 6.1 of the paper: the base model is "a single model obtained by averaging the last
5 checkpoints" (20 for the big model); :func:`average_checkpoints` computes that mean and
:func:`export_model` writes it as ``model.safetensors`` plus ``config.json``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from aiayn.errors import DataError
from aiayn.io import atomic_path, check_free_space, file_sha256, read_json, write_json

log = logging.getLogger(__name__)

CHECKPOINT_RE = re.compile(r"^step-(\d+)\.pt$")
# What aiayn.io.atomic_path leaves behind when a process is killed mid-write.
TEMP_GLOB = ".step-*.pt.*.tmp"
MODEL_FILE, CONFIG_FILE = "model.safetensors", "config.json"


def checkpoint_path(folder: Path, step: int) -> Path:
    return Path(folder) / f"step-{step:08d}.pt"


def checkpoint_step(path: Path) -> int:
    """The step number in a checkpoint's file name (``step-00000120.pt`` → 120)."""
    match = CHECKPOINT_RE.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path}: not a checkpoint file name (step-NNNNNNNN.pt)")
    return int(match.group(1))


def list_checkpoints(folder: Path) -> list[Path]:
    """Checkpoint files in ``folder``, oldest step first; temporary files are ignored."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if CHECKPOINT_RE.match(p.name) and p.is_file()]
    return sorted(found, key=checkpoint_step)


def _fsync_dir(folder: Path) -> None:
    """Make a rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(folder: Path, step: int, state: dict, keep: int,
                    protect: set[int] | frozenset[int] = frozenset(),
                    replaced: set[int] | frozenset[int] = frozenset()) -> Path:
    """Write ``state`` as the checkpoint of ``step``, atomically; keep the newest ``keep``.

    The file appears complete under its final name or not at all. Afterwards the
    checkpoints of the steps in ``replaced`` are deleted (a checkpoint written only to stop
    a run, which this one supersedes), then those with the lowest step numbers until at
    most ``keep`` remain (the one just written always stays), together with temporary files
    that a killed writer left behind (one trainer process writes a folder at a time). The
    steps in ``protect`` (say, the best by validation BLEU) are kept beyond those.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, not {keep}")
    folder = Path(folder)
    final = checkpoint_path(folder, step)
    needed = state_bytes(state)
    check_free_space(final, needed)
    with atomic_path(final, needed=needed) as tmp:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    _fsync_dir(folder)

    for stale in folder.glob(TEMP_GLOB):
        stale.unlink(missing_ok=True)
    others = []
    for path in list_checkpoints(folder):
        if path.name == final.name:
            continue
        if checkpoint_step(path) in replaced:
            path.unlink(missing_ok=True)
            log.debug("removed checkpoint %s, written only to stop the run", path)
        else:
            others.append(path)
    for old in others[:max(len(others) - (keep - 1), 0)]:
        if checkpoint_step(old) in protect:
            continue
        old.unlink(missing_ok=True)
        log.debug("removed old checkpoint %s", old)
    return final


PROGRESS_SUFFIX = ".progress"


def progress_folder(folder: Path) -> Path:
    """``data/checkpoints.progress`` for ``data/checkpoints``: hard links to the checkpoints
    the trainer holds, kept in step by :func:`mirror_checkpoints`.

    Why: ``dvc exp run`` checks every cached output out as it was last committed before it
    runs a stage (``persist: true`` or not). A training that stopped before DVC committed
    its checkpoints (interrupted, killed, or DVC failing to cache them, say on a full disk)
    would find the committed experiment's checkpoints in its folder at the next ``dvc exp
    run`` and its own gone. A second name for each file keeps them, at no cost in disk
    while both names exist; :func:`unsaved_checkpoints` finds what the folder lost.
    """
    folder = Path(folder)
    return folder.with_name(folder.name + PROGRESS_SUFFIX)


def mirror_checkpoints(folder: Path) -> None:
    """Make :func:`progress_folder` hold a hard link to each checkpoint of ``folder`` and
    nothing else. Raises OSError where the file system has no hard links."""
    folder = Path(folder)
    mirror = progress_folder(folder)
    current = {p.name: p for p in list_checkpoints(folder)}
    mirror.mkdir(parents=True, exist_ok=True)  # a first run: nothing of the path may exist yet
    for name, path in current.items():
        link = mirror / name
        if link.exists() and os.path.samefile(link, path):
            continue
        tmp = mirror / f".{name}.link.tmp"
        tmp.unlink(missing_ok=True)
        os.link(path, tmp)
        os.replace(tmp, link)
    for link in list_checkpoints(mirror):
        if link.name not in current:
            link.unlink(missing_ok=True)


def _same_file(a: Path, b: Path) -> bool:
    """One file under two names, or two files with the same bytes (a copy put back)."""
    if os.path.samefile(a, b):
        return True
    return a.stat().st_size == b.stat().st_size and file_sha256(a) == file_sha256(b)


def _readable(path: Path) -> bool:
    try:
        load_checkpoint(path, mmap=True)
    except DataError:
        return False
    return True


def unsaved_checkpoints(folder: Path) -> list[Path]:
    """The checkpoints of :func:`progress_folder` that ``folder`` no longer holds: absent,
    or replaced under the same name by another readable checkpoint (as a checkout does),
    oldest step first. A torn file in ``folder`` does not count: the trainer falls back
    from it as from any torn checkpoint (and with hard links the mirror's name is torn
    too; only a copy of the folder made without them holds other bytes)."""
    folder = Path(folder)
    lost = []
    for link in list_checkpoints(progress_folder(folder)):
        there = folder / link.name
        if not there.is_file() or (not _same_file(link, there) and _readable(there)):
            lost.append(link)
    return lost


def state_bytes(obj: Any) -> int:
    """The bytes of the tensors in a nested dict/list (about a checkpoint file's size)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(state_bytes(v) for v in obj)
    return 0


def load_checkpoint(path: Path, map_location: Any = "cpu", *, mmap: bool = False) -> dict:
    """Load a checkpoint dict with ``weights_only=True``; any failure is a DataError.

    ``mmap=True`` maps the file instead of reading it: tensors that are never touched
    (say, the optimizer state when only the model is wanted) cost no memory.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such checkpoint; run `aiayn train` first")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as exc:  # zip, pickle, EOF and storage errors all mean "unreadable"
        raise DataError(
            f"{path}: unreadable or corrupt checkpoint ({type(exc).__name__}: "
            f"{str(exc)[:200]}); delete it to fall back to the previous one"
        ) from None
    if not isinstance(state, dict):
        raise DataError(f"{path}: holds a {type(state).__name__}, not a checkpoint dict; "
                        "it was not written by `aiayn train`")
    return state


def latest_checkpoint(folder: Path, map_location: Any = "cpu") -> tuple[Path, dict] | None:
    """The newest checkpoint that loads, as (path, state); None if the folder has none.

    An unreadable newest file is skipped with a warning and the previous one is tried.
    If checkpoints exist but none loads, that is a DataError rather than a silent fresh
    start.
    """
    paths = list_checkpoints(folder)
    for path in reversed(paths):
        try:
            return path, load_checkpoint(path, map_location)
        except DataError as exc:
            log.warning("skipping checkpoint: %s", exc)
    if paths:
        raise DataError(f"{folder}: none of the {len(paths)} checkpoints could be read; "
                        "delete them to start training afresh")
    return None


def average_checkpoints(paths: list[Path], key: str = "model") -> dict[str, torch.Tensor]:
    """Element-wise mean of ``state[key]`` over the checkpoint files ``paths``.

    Floating-point tensors are summed in float64 and cast back to their own dtype (so
    float16/bfloat16 stay so); integer and boolean tensors must be equal in every file
    and are kept as they are. Files are loaded one at a time (memory-mapped), so memory
    holds the float64 sums and one file's tensors, never all k state dicts.
    """
    paths = [Path(p) for p in paths]
    if not paths:
        raise ValueError("average_checkpoints needs at least one checkpoint")
    sums: dict[str, torch.Tensor] = {}
    exact: dict[str, torch.Tensor] = {}  # integer/bool tensors: must match across files
    dtypes: dict[str, torch.dtype] = {}
    first = paths[0]
    for i, path in enumerate(paths):
        state = load_checkpoint(path, "cpu", mmap=True)
        tensors = state.get(key)
        if not isinstance(tensors, Mapping):
            raise DataError(f"{path}: no {key!r} state dict in this checkpoint; "
                            "was it written by `aiayn train`?")
        bad = [k for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise DataError(f"{path}: {key!r} entries {bad[:5]} are not tensors")
        if i == 0:
            dtypes = {k: v.dtype for k, v in tensors.items()}
        else:
            _check_same_layout(first, dtypes, sums, exact, path, tensors)
        for name, t in tensors.items():
            if t.is_floating_point():
                if i == 0:
                    sums[name] = t.to(torch.float64, copy=True)
                else:
                    sums[name] += t.to(torch.float64)
            elif i == 0:
                exact[name] = t.clone()
            elif not torch.equal(exact[name], t):
                raise DataError(
                    f"{first} and {path}: the non-floating tensor {key}.{name} "
                    f"({t.dtype}) differs; such tensors cannot be averaged")
        del state, tensors
    n = len(paths)
    out: dict[str, torch.Tensor] = {}
    for name, dtype in dtypes.items():
        out[name] = (sums[name] / n).to(dtype) if name in sums else exact[name]
    return out


def _check_same_layout(first: Path, dtypes: dict[str, torch.dtype], sums: dict,
                       exact: dict, path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    if set(tensors) != set(dtypes):
        missing = sorted(set(dtypes) - set(tensors))[:5]
        extra = sorted(set(tensors) - set(dtypes))[:5]
        raise DataError(
            f"{first} and {path} hold different parameters (only in the first: {missing}; "
            f"only in the second: {extra}); average checkpoints of one training run only")
    for name, t in tensors.items():
        ref = sums.get(name, exact.get(name))
        if t.shape != ref.shape or t.dtype != dtypes[name]:
            raise DataError(
                f"{first} and {path}: {name} is {dtypes[name]} {tuple(ref.shape)} in the "
                f"first and {t.dtype} {tuple(t.shape)} in the second; average checkpoints "
                "of one model configuration only")


def export_model(out_dir: Path, state_dict: dict[str, torch.Tensor], config: dict, *,
                 extra_files: Mapping[str, Path] | None = None) -> None:
    """Write ``out_dir`` as one atomic folder: model.safetensors, config.json and copies
    of ``extra_files`` ({name in the folder: source file}); an old folder is replaced whole.
    """
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in state_dict.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel():  # safetensors refuses tensors that share memory
            t = t.clone()
        seen.add(ptr)
        tensors[name] = t
    with atomic_path(out_dir, directory=True) as tmp:
        save_file(tensors, str(tmp / MODEL_FILE), metadata={"format": "pt"})
        write_json(tmp / CONFIG_FILE, config)
        for name, source in (extra_files or {}).items():
            shutil.copyfile(source, tmp / name)


def load_model_files(out_dir: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The state dict and config of an exported model folder (see :func:`export_model`)."""
    out_dir = Path(out_dir)
    for name in (MODEL_FILE, CONFIG_FILE):
        if not (out_dir / name).is_file():
            raise DataError(f"{out_dir / name}: missing; run `aiayn average` to export "
                            "the model folder")
    try:
        tensors = load_file(str(out_dir / MODEL_FILE), device="cpu")
    except Exception as exc:
        raise DataError(f"{out_dir / MODEL_FILE}: not a readable safetensors file ({exc}); "
                        "re-run `aiayn average`") from None
    try:
        config = read_json(out_dir / CONFIG_FILE)
    except ValueError as exc:
        raise DataError(f"{out_dir / CONFIG_FILE}: not valid JSON ({exc}); "
                        "re-run `aiayn average`") from None
    return tensors, config
