"""A training's checkpoints survive `dvc exp run` checking the committed ones out over them.

Before it runs a stage, `dvc exp run` checks every cached output out as last committed, so
the checkpoints of a training that stopped before DVC committed them are replaced by the
committed experiment's. The trainer keeps hard links to its checkpoints in
`checkpoints.progress` and puts them back (aiayn.training.checkpoint.progress_folder). Here the
checkout is simulated by replacing the folder with a copy of an earlier one, as DVC's copy
link type does; tests/test_experiments.py runs the real `dvc exp run`.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch

from aiayn.training.checkpoint import (
    list_checkpoints,
    load_checkpoint,
    mirror_checkpoints,
    progress_folder,
    save_checkpoint,
    unsaved_checkpoints,
)
from tests.test_training import assert_bitwise_equal, make_trainer


def names(folder: Path) -> list[str]:
    return [p.name for p in list_checkpoints(folder)]


def dvc_checkout(folder: Path, committed: Path) -> None:
    """What `dvc exp run` does to a persisted output before the stage runs: the folder
    becomes a copy of its committed state."""
    shutil.rmtree(folder)
    shutil.copytree(committed, folder)


def test_the_mirror_follows_every_save_and_every_pruned_checkpoint(tmp_path):
    folder = tmp_path / "checkpoints"
    for step in range(1, 6):
        save_checkpoint(folder, step, {"w": torch.full((4,), float(step))}, keep=2)
        mirror_checkpoints(folder)
        assert names(progress_folder(folder)) == names(folder)
    assert names(folder) == ["step-00000004.pt", "step-00000005.pt"]
    for link in list_checkpoints(progress_folder(folder)):
        assert os.path.samefile(link, folder / link.name)  # a second name, no second copy
    assert unsaved_checkpoints(folder) == []


def test_unsaved_checkpoints_are_those_the_folder_lost_or_holds_another_checkpoint_for(
        tmp_path):
    folder = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        save_checkpoint(folder, step, {"w": torch.full((4,), float(step))}, keep=5)
    mirror_checkpoints(folder)
    committed = tmp_path / "committed"
    committed.mkdir()
    shutil.copy(folder / "step-00000001.pt", committed)  # the same bytes, another inode
    torch.save({"w": torch.zeros(4)}, committed / "step-00000002.pt")  # another run's
    torn = (folder / "step-00000004.pt").read_bytes()[:100]
    (committed / "step-00000004.pt").write_bytes(torn)  # torn: the trainer skips it itself
    dvc_checkout(folder, committed)
    lost = unsaved_checkpoints(folder)
    assert [p.name for p in lost] == ["step-00000002.pt", "step-00000003.pt"]
    assert all(p.parent == progress_folder(folder) for p in lost)
    assert torch.equal(load_checkpoint(lost[-1])["w"], torch.full((4,), 3.0))


def test_an_interrupted_run_whose_checkpoints_were_checked_out_over_resumes_from_its_own(
        toy_workspace, tmp_path, caplog):
    mine = {"train": {"lr_scale": 2.0}}
    run = tmp_path / "run"
    make_trainer(toy_workspace, run, {"train": {"steps": 6}}).fit()  # the committed run
    committed = tmp_path / "committed"
    shutil.copytree(run / "checkpoints", committed)
    part = make_trainer(toy_workspace, run, mine)  # sets the committed run aside
    part.fit(should_stop=lambda: part.state.step == 5)  # stopped before DVC committed it
    dvc_checkout(run / "checkpoints", committed)
    assert names(run / "checkpoints")[-1] == "step-00000006.pt"

    caplog.set_level(logging.WARNING)
    resumed = make_trainer(toy_workspace, run, mine)
    assert resumed.state.step == 5
    assert "This run's were put back" in caplog.text
    put_aside = list((tmp_path / "run/checkpoints.replaced").glob("*-checked-out"))
    assert len(put_aside) == 1 and names(put_aside[0]) == names(committed)
    resumed.fit()
    full = make_trainer(toy_workspace, tmp_path / "full", mine)
    full.fit()
    last = "checkpoints/step-00000012.pt"
    assert_bitwise_equal(load_checkpoint(run / last)["model"],
                         load_checkpoint(tmp_path / "full" / last)["model"])
    assert names(progress_folder(run / "checkpoints")) == names(run / "checkpoints")


def test_the_progress_of_other_settings_is_kept_aside_and_the_folder_s_run_goes_on(
        toy_workspace, tmp_path, caplog):
    run = tmp_path / "run"
    make_trainer(toy_workspace, run, {"train": {"steps": 3}}).fit()
    committed = tmp_path / "committed"
    shutil.copytree(run / "checkpoints", committed)
    other = make_trainer(toy_workspace, run, {"train": {"steps": 6, "lr_scale": 2.0}})
    other.fit()
    dvc_checkout(run / "checkpoints", committed)  # say, `dvc exp apply` of the first run

    caplog.set_level(logging.WARNING)
    longer = make_trainer(toy_workspace, run, {"train": {"steps": 6}})
    assert longer.state.step == 3  # the folder's run continues
    assert "made with other settings (train.lr_scale: 2.0 -> 1.0)" in caplog.text
    kept = list((run / "checkpoints.replaced").glob("*-progress"))
    assert len(kept) == 1 and names(kept[0])[-1] == "step-00000006.pt"
    assert load_checkpoint(kept[0] / "step-00000006.pt")["meta"]["identity"][
        "train.lr_scale"] == 2.0
    assert names(progress_folder(run / "checkpoints")) == names(committed)


def test_a_folder_deleted_by_hand_starts_afresh_and_its_files_are_kept_aside(
        toy_workspace, tmp_path, caplog):
    run = tmp_path / "run"
    make_trainer(toy_workspace, run, {"train": {"steps": 3}}).fit()
    shutil.rmtree(run / "checkpoints")
    caplog.set_level(logging.WARNING)
    fresh = make_trainer(toy_workspace, run, {"train": {"steps": 3}})
    assert fresh.state.step == 0
    assert "holds no checkpoints (deleted to start afresh?)" in caplog.text
    kept = list((run / "checkpoints.replaced").glob("*-progress"))
    assert len(kept) == 1 and names(kept[0]) == ["step-00000003.pt"]
    assert list_checkpoints(progress_folder(run / "checkpoints")) == []


def test_a_first_run_into_a_folder_whose_parents_do_not_exist_yet_keeps_its_mirror(
        toy_workspace, tmp_path, caplog):
    from aiayn.training.build import build_trainer
    from aiayn.training.distributed import World
    from tests.test_training import paths

    settings = make_trainer(toy_workspace, tmp_path / "settings", {"train": {"steps": 6}})
    run = tmp_path / "new" / "run"  # as `aiayn train --checkpoints new/run/checkpoints`
    with caplog.at_level(logging.WARNING, logger="aiayn"):
        trainer = build_trainer(settings.p, settings.checkpoint_meta["vocab_size"],
                                settings.checkpoint_meta["tokenizer_sha256"],
                                paths(toy_workspace, run), World(), progress=False)
        trainer.fit()
    assert "cannot keep hard links" not in caplog.text
    folder = run / "checkpoints"
    assert names(progress_folder(folder)) == names(folder) != []
