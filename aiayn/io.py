"""Crash-safe writes: every output appears complete under its final name, or not at all.

Each writer produces a temporary sibling and renames it into place (``os.replace`` is
atomic within a filesystem), so a killed stage never leaves a half-written file that looks
finished, and a failed stage leaves the previous output untouched.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aiayn.errors import OutputError

# Why a write fails on a healthy machine: no space, a quota, a read-only or forbidden folder,
# a file-size limit (ulimit -f). These become an OutputError, which names the folder.
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM,
                          errno.EFBIG})


def _write_error(exc: BaseException | None) -> OSError | None:
    """The OSError of WRITE_ERRNOS behind ``exc``, if any: a writer may raise another
    error while cleaning up after it (torch.save's zip writer raises a RuntimeError)."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno in WRITE_ERRNOS:
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def free_bytes(folder: str | Path) -> int | None:
    """Free space in ``folder``'s filesystem (its nearest existing ancestor); None if unknown."""
    folder = Path(folder).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def human_bytes(n: float) -> str:
    """1000 bytes, 3.9 KB, 1.5 GB."""
    if n < 1024:
        return f"{int(n)} bytes"
    units, i = ("KB", "MB", "GB", "TB"), -1
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:,.1f} {units[i]}"


def write_failed(final: str | Path, exc: OSError, needed: int | None = None) -> OutputError:
    """The one-line error for a failed write of ``final``."""
    final = Path(final)
    free = free_bytes(final.parent)
    code = errno.errorcode.get(exc.errno or 0, "error")
    room = [] if free is None else [f"{human_bytes(free)} free there"]
    room += [] if needed is None else [f"about {human_bytes(needed)} needed"]
    fix = ("make the folder writable" if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
           else "raise the file-size limit (ulimit -f)" if exc.errno == errno.EFBIG
           else "free some space")
    return OutputError(
        f"{final.parent}: cannot write {final.name} ({exc.strerror or exc}, {code}"
        f"{'; ' + ', '.join(room) if room else ''}); {fix} and run the same command again "
        "(what was written before is intact)")


def check_free_space(final: str | Path, needed: int) -> None:
    """Refuse to start writing ``needed`` bytes at ``final`` where they cannot fit."""
    free = free_bytes(Path(final).parent)
    if free is not None and free < needed:
        raise write_failed(final, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), needed)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_output_path(final: str | Path, *, directory: bool = False) -> None:
    """Refuse an output path that can never be written, before any work: a folder where a
    file output goes (``directory=False``), or a file where a folder on the way is needed.
    Stages call it on their output options up front; :func:`atomic_path` calls it too."""
    final = Path(final)
    if not directory and final.is_dir():
        raise OutputError(
            f"{final}: is a folder, but this output is a file; name a file (e.g. a path inside "
            "that folder) or move the folder away, and run the same command again")
    for parent in final.parents:
        if parent.exists():
            if not parent.is_dir():
                raise OutputError(
                    f"{final}: cannot be written because {parent} is a file, not a folder; "
                    "name another path or move that file away")
            break


@contextlib.contextmanager
def atomic_path(final: str | Path, *, directory: bool = False,
                needed: int | None = None) -> Iterator[Path]:
    """Yield a temporary path beside ``final``; on success move it to ``final``.

    With ``directory=True`` the temporary path is an (empty) directory and an existing
    ``final`` directory is replaced as a whole. On any exception the temporary path is
    removed and ``final`` is left as it was; a write that fails for want of space or
    permission (WRITE_ERRNOS) becomes an OutputError naming the folder (and ``needed``,
    the expected size in bytes, if given).
    """
    final = Path(final)
    check_output_path(final, directory=directory)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        if directory:
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp",
                                        dir=final.parent))
        else:
            fd, name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp",
                                        dir=final.parent)
            os.close(fd)
            tmp = Path(name)
    except OSError as exc:
        if exc.errno in WRITE_ERRNOS:
            raise write_failed(final, exc, needed) from None
        raise
    old = None
    try:
        yield tmp
        # mkstemp/mkdtemp create private (0600/0700) paths; give the result the permissions
        # an ordinary file or folder would get.
        if tmp.exists():
            os.chmod(tmp, (0o777 if directory else 0o666) & ~_umask())
        if directory:
            if final.exists():
                old = final.with_name(f".{final.name}.old-{os.getpid()}")
                os.replace(final, old)
            os.replace(tmp, final)
            if old is not None:
                moved, old = old, None  # final is the new folder now: the old one may go
                if moved.is_dir():
                    shutil.rmtree(moved, ignore_errors=True)
                else:
                    moved.unlink(missing_ok=True)
        else:
            os.replace(tmp, final)
    except BaseException as exc:
        # Stopped between the two renames (an interrupt, a failing rename): put the previous
        # output back under its name rather than leave it hidden as .NAME.old-PID.
        if old is not None and not final.exists() and old.exists():
            os.replace(old, final)
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        cause = _write_error(exc)
        if cause is not None:
            raise write_failed(final, cause, needed) from None
        raise


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | Path, data: Any) -> None:
    """Write pretty, key-sorted JSON atomically (stable diffs for git-tracked metrics)."""
    write_text(path, json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))
