"""Atomic writes: complete under the final name, or not at all."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from aiayn.errors import OutputError
from aiayn.io import atomic_path, check_output_path, read_json, write_json


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_files_and_folders_get_ordinary_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        write_json(tmp_path / "m.json", {"a": 1})
        with atomic_path(tmp_path / "folder", directory=True) as tmp:
            (tmp / "x").write_text("x")
    finally:
        os.umask(old)
    assert mode(tmp_path / "m.json") == 0o644
    assert mode(tmp_path / "folder") == 0o755
    assert read_json(tmp_path / "m.json") == {"a": 1}


def test_failure_keeps_the_previous_content_and_leaves_no_temporary(tmp_path):
    write_json(tmp_path / "m.json", {"v": 1})
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "m.json") as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "old").write_text("old")
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "d", directory=True) as tmp:
        (tmp / "new").write_text("new")
        raise RuntimeError("crash")
    assert read_json(tmp_path / "m.json") == {"v": 1}
    assert [p.name for p in (tmp_path / "d").iterdir()] == ["old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "m.json"]


def test_folder_is_replaced_whole(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "stale").write_text("stale")
    with atomic_path(tmp_path / "d", directory=True) as tmp:
        (tmp / "fresh").write_text("fresh")
    assert [p.name for p in (tmp_path / "d").iterdir()] == ["fresh"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_a_folder_where_a_file_goes_is_refused_before_the_work(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "kept").write_text("kept")
    with pytest.raises(OutputError, match=r"out: is a folder, but this output is a file"):
        with atomic_path(tmp_path / "out"):
            pytest.fail("the body ran: the work would have been done for nothing")
    (tmp_path / "file").write_text("a file")
    with pytest.raises(OutputError, match=r"file is a file, not a folder"):
        check_output_path(tmp_path / "file" / "sub" / "m.json")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["kept"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "out"]


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, OSError])
def test_a_stop_between_the_two_renames_puts_the_previous_folder_back(tmp_path, monkeypatch,
                                                                     interrupt):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "old").write_text("old")
    real_replace = os.replace

    def replace(src, dst):
        # The second rename, the new folder into place, is where the stop comes.
        if Path(dst) == tmp_path / "d" and Path(src).name.endswith(".tmp"):
            raise interrupt("stopped between the renames")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(interrupt), atomic_path(tmp_path / "d", directory=True) as tmp:
        (tmp / "new").write_text("new")
    monkeypatch.undo()
    assert [p.name for p in (tmp_path / "d").iterdir()] == ["old"]
    assert (tmp_path / "d" / "old").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
