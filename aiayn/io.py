"""Crash-safe writes: every output appears complete under its final name, or not at all.

Each writer produces a temporary sibling and renames it into place (``os.replace`` is
atomic within a filesystem), so a killed stage never leaves a half-written file that looks
finished, and a failed stage leaves the previous output untouched.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(final: str | Path, *, directory: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``final``; on success move it to ``final``.

    With ``directory=True`` the temporary path is an (empty) directory and an existing
    ``final`` directory is replaced as a whole. On any exception the temporary path is
    removed and ``final`` is left as it was.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    if directory:
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
        os.close(fd)
        tmp = Path(name)
    try:
        yield tmp
        # mkstemp/mkdtemp create private (0600/0700) paths; give the result the permissions
        # an ordinary file or folder would get.
        if tmp.exists():
            os.chmod(tmp, (0o777 if directory else 0o666) & ~_umask())
        if directory:
            old = None
            if final.exists():
                old = final.with_name(f".{final.name}.old-{os.getpid()}")
                os.replace(final, old)
            os.replace(tmp, final)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | Path, data: Any) -> None:
    """Write pretty, key-sorted JSON atomically (stable diffs for git-tracked metrics)."""
    write_text(path, json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))
