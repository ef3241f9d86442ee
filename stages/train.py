"""train: shards → checkpoints (data/checkpoints) + metrics/train.json and loss/lr curves."""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

from aiayn.data.subword import merge_parents
from aiayn.data.tokenizer import load_tokenizer
from aiayn.errors import AiaynError
from aiayn.io import check_output_path, file_sha256
from aiayn.plots import plot_training_curves
from aiayn.precision import hardware, precision_name
from aiayn.tracking import (
    RUN_FILE,
    Tracker,
    default_run_name,
    git_commit,
    load_run_id,
    save_run_id,
)
from aiayn.training import distributed
from aiayn.training.build import build_trainer, device_kind
from aiayn.training.distributed import world_from_env
from aiayn.training.loop import Trainer, TrainingListener, TrainPaths
from aiayn.training.run_log import TrainRow, ValidRow
from stages.common import ParamsPath, log, read_params, single_command_app, stage
from stages.params import nearest_preset


def torchrun_command(nproc: int, max_restarts: int, argv: list[str]) -> list[str]:
    """`torchrun --standalone --nproc-per-node N --max-restarts R -m stages.train ARGS`,
    ARGS being this command's own (``argv`` is sys.argv: `aiayn train ...` or
    `python -m stages.train ...`)."""
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    rest = argv[2:] if argv[1:2] == ["train"] else argv[1:]
    return [torchrun, "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "-m", "stages.train", *rest]


# torchrun shares its rendezvous TCPStore with the workers by default; after a restart the
# new workers can then read the previous attempt's addresses from it and fail to connect
# (pytorch/pytorch#135712, #167288). Unshared, every attempt gets a store of its own.
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def relaunch_under_torchrun(nproc: int, max_restarts: int) -> None:
    """Replace this process by torchrun running this command in N processes. Only `aiayn
    train` itself may: a script or notebook that calls the stage function would be replaced
    by torchrun running the script's own command line."""
    if not launched_as_command():
        raise AiaynError(f"train.nproc_per_node is {nproc}, but the train stage was called "
                         "from Python, whose process it cannot re-launch under torchrun; run "
                         "`aiayn train`, or start your script under torchrun "
                         f"(torchrun --nproc-per-node {nproc} script.py), or set "
                         "train.nproc_per_node: 1")
    args = torchrun_command(nproc, max_restarts, sys.argv)
    log.info("train: %d processes per node, re-launching under torchrun (%d restart%s after "
             "a lost process)", nproc, max_restarts, "" if max_restarts == 1 else "s")
    os.execve(args[0], args, {**TORCHRUN_ENV, **os.environ})


# Set in the environment of the process `aiayn train` re-launches on another allocator, so
# that it is tried once.
ALLOCATOR_RELAUNCHED = "AIAYN_ALLOCATOR_RELAUNCHED"


def launched_as_command() -> bool:
    """True when this process is `aiayn train` or `python -m stages.train` itself, not a
    test runner, notebook or script that calls the stage function: only then may the stage
    replace the process."""
    prog = Path(sys.argv[0])
    if prog.name == "aiayn":
        return sys.argv[1:2] == ["train"]
    return prog.resolve() == Path(__file__).resolve()


def relaunch_with_allocator(p) -> None:
    """Replace this process by the same command on the allocator ``train.allocator`` picks
    (aiayn.training.memory.choose_allocator: on a CPU, tcmalloc or jemalloc where installed), when it
    is not already the one loaded. A named allocator that is not installed is an error."""
    from aiayn.training.memory import (
        allocator_env,
        choose_allocator,
        install_hint,
        loaded_allocator,
    )

    on_cpu = device_kind(p.train.device) == "cpu"
    try:
        wanted = choose_allocator(p.train.allocator, on_cpu)
    except FileNotFoundError as e:
        raise AiaynError(str(e)) from None
    loaded = loaded_allocator()
    if wanted == "glibc" and loaded == "glibc" and on_cpu and p.train.allocator == "auto":
        log.info("train: on glibc's malloc; with tcmalloc, CPU training ran 1.1-1.6x as fast in "
                 "0.4-0.7x the memory (the preset's fp32 hour on an AVX2 CPU: 1.20x the steps; "
                 "%s; aiayn/training/memory.py)", install_hint("tcmalloc"))
    if wanted == loaded or wanted == "glibc":  # glibc cannot be unloaded: it stays as it is
        return
    relaunched = os.environ.get(ALLOCATOR_RELAUNCHED)
    if relaunched or not launched_as_command():
        # Called from Python (tests, notebooks), auto says so quietly; a named allocator, or
        # a re-launch that did not load it, warns.
        report = log.warning if relaunched or p.train.allocator != "auto" else log.info
        report("train: train.allocator %s: running on %s (%s)", p.train.allocator, loaded,
               "the re-launch did not load it" if relaunched
               else "the stage was called from Python; preload it with LD_PRELOAD")
        return
    env = {**allocator_env(wanted), ALLOCATOR_RELAUNCHED: wanted}
    log.info("train: re-launching on %s (LD_PRELOAD=%s; train.allocator: %s)", wanted,
             env["LD_PRELOAD"], p.train.allocator)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


@stage
def train(
    params: ParamsPath = Path("params.yaml"),
    shards: Annotated[Path, typer.Option(help="Shards from `aiayn shard` (train/ and valid/).")] = Path("data/shards"),
    tokenizer: Annotated[Path, typer.Option(help="Tokenizer from `aiayn vocab`; its hash is recorded in every checkpoint.")] = Path("data/vocab/tokenizer.json"),
    raw: Annotated[Path, typer.Option(help="Raw splits from `aiayn download`: the valid source and references of validation BLEU (train.valid_bleu_every).")] = Path("data/raw"),
    checkpoints: Annotated[Path, typer.Option(help="Checkpoint folder; an existing run there is resumed.")] = Path("data/checkpoints"),
    metrics: Annotated[Path, typer.Option(help="Final figures (loss, perplexity, steps, tokens, time).")] = Path("metrics/train.json"),
    train_log: Annotated[Path, typer.Option(help="Step-wise train loss, lr, grad norm, tokens/s (TSV, for dvc plots).")] = Path("metrics/train_log.tsv"),
    valid_log: Annotated[Path, typer.Option(help="Step-wise validation loss and perplexity (TSV).")] = Path("metrics/valid_log.tsv"),
    curves: Annotated[Path, typer.Option(help="The loss, learning-rate and throughput curves as one PNG.")] = Path("metrics/training_curves.png"),
    run_dir: Annotated[Path | None, typer.Option(help="Write every output of the run under this folder instead (checkpoints/, train.json, train_log.tsv, valid_log.tsv, training_curves.png): a training apart from the pipeline's, e.g. a short check of a multi-GPU setup (docs/gpus.md).")] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    mlflow: Annotated[bool, typer.Option(help="Log to MLflow (MLFLOW_TRACKING_URI, default sqlite:///mlflow.db).")] = True,
) -> None:
    """Train the Transformer on the token-budget shards (Section 5 of the paper).

    Reads: the params aiayn.config.PARAM_EFFECTS declares for train (`seed`, `model.*`,
    `train.*` but the averaging's, and `data.src_lang`/`tgt_lang` for validation BLEU);
    SHARDS/{train,valid}, TOKENIZER, and
    RAW/valid.parquet when `train.valid_bleu_every` is on. Writes: CHECKPOINTS/step-*.pt (model, optimizer, schedule, RNG states, data
    cursor; every `train.checkpoint_every_steps` steps and/or `checkpoint_every_minutes`,
    the last `train.keep_checkpoints` kept), METRICS (with the precision `auto` resolved to,
    the CPU or GPU and any instruction caps in the environment, the kernels, the tokens the
    softmax spans (`model.output_vocab`), the steps reached and why training stopped: steps, `train.max_minutes` or an interruption), TRAIN_LOG, VALID_LOG, CURVES, and an
    MLflow run (sqlite:///mlflow.db unless MLFLOW_TRACKING_URI says otherwise) with every
    param, the step curves, the tokenizer and CURVES, named after the DVC experiment or else
    the preset and commit (`multi30k@1f32a3c`); its id goes to CHECKPOINTS/mlflow_run.json
    so that the later stages log into the same run. Any error ends that run FAILED.

    An existing run in CHECKPOINTS resumes where it stopped (a killed run ends bitwise where
    an uninterrupted one would, on CPU); Ctrl-C or SIGTERM writes a checkpoint first, then
    the stage exits 130 or 143 (not 0), so that DVC stops there instead of scoring a partial
    run; run it again to resume.
    Several processes: set `train.nproc_per_node` (this command re-launches itself under
    torchrun; `train.max_restarts` restarts the group after a lost process, and the run
    resumes from its last checkpoint), or call torchrun yourself, e.g. on each of two
    machines that share the checkpoint folder:
    `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 2 --nproc-per-node 8
    --rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id RUN --max-restarts 3
    -m stages.train` (the variable makes restarts work: pytorch/pytorch#135712). GPUs,
    several machines, SLURM and checks: docs/gpus.md. `train.tokens_per_step` is the step on
    any number of processes: each one's micro-batches are planned when training starts.
    """
    p = read_params(params)
    if run_dir is not None:
        checkpoints, metrics = run_dir / "checkpoints", run_dir / "train.json"
        train_log, valid_log = run_dir / "train_log.tsv", run_dir / "valid_log.tsv"
        curves = run_dir / "training_curves.png"
    for path in (metrics, train_log, valid_log, curves):  # written at the end: check now
        check_output_path(path)
    check_output_path(checkpoints, directory=True)
    try:
        world = world_from_env()
    except ValueError as exc:
        raise AiaynError(str(exc)) from None
    relaunch_with_allocator(p)
    if p.train.nproc_per_node > 1 and "LOCAL_RANK" not in os.environ:
        relaunch_under_torchrun(p.train.nproc_per_node, p.train.max_restarts)
    if hasattr(signal, "SIGXFSZ"):
        # A file-size limit (ulimit -f) then fails a write with a clear error (and the
        # checkpoints before it intact) instead of killing the process mid-write.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    tok = load_tokenizer(tokenizer)
    paths = TrainPaths(shards=shards, checkpoints=checkpoints, metrics=metrics,
                       train_log=train_log, valid_log=valid_log)
    stop = {"signal": None}  # the first SIGINT or SIGTERM received

    def request_stop(signum, frame):
        if stop["signal"] is not None:  # a second Ctrl-C: stop at once
            raise KeyboardInterrupt
        stop["signal"] = signum
        log.info("train: %s received, stopping after this step", signal.Signals(signum).name)

    # The stage owns the MLflow run from start to end: whatever exception ends the stage
    # ends the run FAILED, an interrupt (a second Ctrl-C) KILLED (Tracker.__exit__).
    try:
        with Tracker(enabled=mlflow and world.is_main) as tracker:
            hook = (validation_bleu(p, raw, tok) if p.train.valid_bleu_every and world.is_main
                    else None)
            merges = merge_parents(tok) if p.train.subword_split else None
            rows = TrackedRows(tracker)
            trainer = build_trainer(p, tok.get_vocab_size(), file_sha256(tokenizer), paths,
                                    world, progress=progress, valid_bleu=hook, merges=merges,
                                    listeners=[rows], run_files=(RUN_FILE,))
            start_tracking(tracker, trainer, p, checkpoints / RUN_FILE, rows)
            signal.signal(signal.SIGTERM, request_stop)
            signal.signal(signal.SIGINT, request_stop)
            resumed_at = trainer.state.step
            summary = trainer.fit(should_stop=lambda: stop["signal"] is not None)
            trainer.write_logs()
            trainer.write_summary(summary)
            if world.is_main:
                plot_training_curves(train_log, valid_log, curves)
                log_results(tracker, summary, [metrics, train_log, valid_log], curves, tokenizer)
                log.info("train: %d steps, valid loss %s, ppl %s, %.0f tokens/s",
                         summary["steps"], _round(summary["valid_loss"]),
                         _round(summary["valid_ppl"]), summary["tokens_per_s"])
            done = summary["steps"] >= p.train.steps or summary["stopped_by"] == "time budget"
            tracker.end("FINISHED" if done else "KILLED",
                        unchanged=summary["steps"] == resumed_at)
    finally:
        distributed.shutdown()
    if summary["stopped_by"] == "interrupted" and stop["signal"] is not None:
        # Exit as a process ended by the signal does (128 + its number), not 0: else
        # `dvc repro` or a killed `dvc exp run` would take the partial run as the stage's
        # result, lock it and go on to average, decode and score it.
        code = 128 + stop["signal"]
        log.warning("train: stopped by %s at step %d; its checkpoint is written. Exiting with "
                    "%d so that no later stage runs on a partial model: run the stage again "
                    "(or `dvc repro`) to resume.", signal.Signals(stop["signal"]).name,
                    summary["steps"], code)
        raise typer.Exit(code)


class TrackedRows(TrainingListener):
    """The loop's log rows into the MLflow run. A run killed after its last checkpoint had
    logged the rows after it; resumed, it computes them again, and they are not sent twice
    (``since``: the last step the run holds, per row type)."""

    def __init__(self, tracker: Tracker):
        self.tracker = tracker
        self.since: dict[type, int] = {}

    def _send(self, row: TrainRow | ValidRow) -> None:
        if row.step > self.since.get(type(row), -1):
            self.tracker.log_metrics(row.metrics(), step=row.step)

    def on_train_row(self, row: TrainRow) -> None:
        self._send(row)

    def on_valid_row(self, row: ValidRow) -> None:
        self._send(row)


def start_tracking(tracker: Tracker, trainer: Trainer, p, run_file: Path,
                   rows: TrackedRows) -> None:
    """Start (or resume) the run's MLflow run and record its id beside the checkpoints
    (RUN_FILE), so that a resumed training and the later stages log into the same run. A
    run that goes on from before its cooldown (aiayn.training.run_store) starts a new MLflow run
    holding its curves up to there and naming the run it branched from."""
    world = trainer.world
    branched = trainer.store.branched_from
    saved = load_run_id(run_file)  # none after a set-aside or a branch: they move it aside
    run_id = tracker.start(
        run_name(p), p.model_dump(mode="json"),
        tags={"stage": "train", "world_size": str(world.size),
              # what auto resolved to on this machine, beside the params as written
              "precision": precision_name(trainer.amp_dtype),
              **hardware(trainer.device),  # the CPU or GPU, and any instruction caps
              "kernels": p.train.kernels, "compile": str(p.train.compile).lower(),
              "allocator": trainer.allocator},
        run_id=saved)
    if not world.is_main:
        return
    save_run_id(run_file, run_id)
    if saved is not None and run_id == saved:  # rows logged before a kill are not sent again
        for row_type, key in ((TrainRow, "train/loss"), (ValidRow, "valid/loss")):
            if (last := tracker.last_step(key)) is not None:
                rows.since[row_type] = last
    if branched is not None and run_id is not None:
        for row in [*trainer.log.train, *trainer.log.valid]:
            tracker.log_metrics(row.metrics(), step=row.step)
        old = load_run_id(branched["aside"] / run_file.name)
        tracker.set_tags({"branched_from_run": str(old), "branched_at_step": str(branched["step"])})


def run_name(p) -> str | None:
    """The MLflow run's name: the DVC experiment's under `dvc exp run`; else what the params
    are and the code they ran with, e.g. ``multi30k@1f32a3c`` (the preset they equal),
    ``multi30k+2@1f32a3c`` (the nearest preset, 2 settings changed) or ``params@1f32a3c``
    (no conf/ here). Stages run in the repository's root, where conf/ and git are."""
    if name := default_run_name():
        return name
    commit = git_commit()
    return preset_of(p, Path("conf")) + (f"@{commit[:7]}" if commit else "")


def preset_of(p, conf_dir: Path) -> str:
    """The preset in CONF_DIR/experiment/ that ``p`` equals, or the nearest with the number
    of settings that differ (``multi30k+2``); ``params`` when there is none to compare."""
    try:
        found = nearest_preset(p.model_dump(mode="json"), conf_dir)
    except AiaynError:  # a conf/ that does not compose
        found = None
    if found is None:
        return "params"
    preset, changed = found
    return preset if not changed else f"{preset}+{len(changed)}"


def log_results(tracker: Tracker, summary: dict, metric_files: list[Path], curves: Path,
                tokenizer: Path) -> None:
    tracker.log_metrics({f"final/{k}": float(v) for k, v in summary.items()
                         if isinstance(v, int | float) and v is not None})
    tracker.set_tags({"stopped_by": str(summary["stopped_by"])})
    for path in metric_files:
        tracker.log_artifact(path, "metrics")
    tracker.log_artifact(curves, "plots")
    tracker.log_artifact(tokenizer, "tokenizer")


def validation_bleu(p, raw: Path, tok):
    """The hook that translates the valid split (or its first sentences) and scores it."""
    from aiayn.decoding.translation import ValidationBleu

    hook = ValidationBleu.from_params(p, raw, tok)
    log.info("train: validation BLEU every %d steps on %d valid sentences, beam %d",
             p.train.valid_bleu_every, len(hook.sources), hook.beam.beam)
    return hook


def _round(x):
    return None if x is None else round(x, 4)


app = single_command_app(train, "Train the Transformer.")

if __name__ == "__main__":
    app()
