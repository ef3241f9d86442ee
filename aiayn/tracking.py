"""The one door to MLflow: params, metrics, tags and artifacts, and nothing that stops training.

``Tracker`` drives ``mlflow.MlflowClient`` with explicit run ids (no fluent, global active
run). MLflow is a mirror: every number also goes to ``metrics/``, so a failing MLflow costs one
warning and turns the tracker off. Here is what MLflow lacks: the store next to the DVC root, a
probe that gives up in seconds, a lock and retries for parallel writers of one SQLite file, a
run's end time summed over resumes, and child runs for other decoding or averaging settings.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from aiayn.config import after_training, flatten
from aiayn.io import write_json

log = logging.getLogger("aiayn")

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
RUN_FILE = "mlflow_run.json"  # beside a run's checkpoints: the id of the run it logs into
# MLflow 3's UI opens an experiment in its model-training view by this tag, not by a guess.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING_KIND = "custom_model_development"
# The tag of a child run made by `dvc repro` (an experiment's child runs carry dvc_experiment).
VARIANT_TAG = "aiayn_variant"
# MLflow retries for minutes by default: a server that dies stalls training once (3 x 30 s).
HTTP_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
PROBE_LIMITS = {"max_retries": 1, "backoff_factor": 1, "timeout": 3}  # is a server there?


def configure() -> None:
    """MLflow's process-wide settings for a stage that tracks: ``HTTP_LIMITS`` and logging at
    WARNING, unless the user set them; no urllib3 warning per retry. ``Tracker.start`` calls it."""
    for name, value in {**HTTP_LIMITS, "MLFLOW_LOGGING_LEVEL": "WARNING"}.items():
        os.environ.setdefault(name, value)
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)


def resolve_tracking_uri(tracking_uri: str | None = None) -> str:
    """The given URI, else ``$MLFLOW_TRACKING_URI``, else ``mlflow.db`` in the DVC root
    (``$DVC_ROOT``: the user's repository, also for a queued experiment that runs in a copy,
    whose own store would vanish with it), else ``mlflow.db`` in the current directory."""
    if tracking_uri or (tracking_uri := os.environ.get("MLFLOW_TRACKING_URI")):
        return tracking_uri
    if dvc_root := os.environ.get("DVC_ROOT"):
        return f"sqlite:///{Path(dvc_root).resolve() / 'mlflow.db'}"
    return DEFAULT_TRACKING_URI


def default_run_name() -> str | None:
    """The DVC experiment's name under ``dvc exp run``; else None."""
    return os.environ.get("DVC_EXP_NAME") or None


def save_run_id(path: Path, run_id: str | None, tracking_uri: str | None = None) -> None:
    """Record the run id (and where it lives) so that a restarted stage can resume the run.
    A SQLite store's file is also recorded relative to ``path``'s folder, so that the link
    holds when the repository (run file and ``mlflow.db`` together) is moved or copied."""
    uri = resolve_tracking_uri(tracking_uri)
    record = {"run_id": run_id, "tracking_uri": uri}
    if (db := sqlite_path(uri)) is not None:
        try:
            relative = os.path.relpath(db.resolve(), Path(path).parent.resolve())
            record["sqlite_from_run_file"] = relative
        except ValueError:  # on Windows, a store on another drive has no relative path
            pass
    write_json(path, record)


def load_run_id(path: Path, tracking_uri: str | None = None) -> str | None:
    """The run id saved at ``path``; None if the file is missing or unreadable, or (with
    ``tracking_uri`` given) if it was saved for another store, where it names no run."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        data = e
    if not isinstance(data, dict):
        log.warning("%s holds no run id (%s); starting a new MLflow run", path, data)
        return None
    run_id, saved = data.get("run_id"), data.get("tracking_uri")
    if tracking_uri is not None and saved and saved != tracking_uri:  # the same SQLite file?
        now = sqlite_path(tracking_uri)
        was = [sqlite_path(saved)]  # as saved, and as seen from the run file (a moved repository)
        if isinstance(relative := data.get("sqlite_from_run_file"), str):
            was.append(Path(path).parent / relative)
        if now is None or not any(w is not None and w.resolve() == now.resolve() for w in was):
            return None
    return run_id if isinstance(run_id, str) and run_id else None


def variant_name(logged: Mapping[str, str], flat: Mapping[str, str],
                 keys: Collection[str]) -> str | None:
    """The settings among ``keys`` whose value in ``flat`` differs from the one a run
    ``logged`` (if it did), as a run name ("decode.alpha=1.0, decode.beam=1"); else None."""
    changed = [f"{k}={flat[k]}" for k in sorted(keys)
               if k in flat and k in logged and logged[k] != flat[k]]
    return ", ".join(changed).replace("'", "")[:250] if changed else None  # a run name's limit


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` tracking URI; None for other stores."""
    is_sqlite = tracking_uri.startswith("sqlite:///")
    return Path(tracking_uri.removeprefix("sqlite:///").split("?", 1)[0]) if is_sqlite else None


def git_commit(cwd: str | Path | None = None) -> str | None:
    """``git rev-parse HEAD`` in ``cwd`` (default: the current directory), or None. (MLflow
    guesses the running script's repository: for a queued DVC experiment, not its copy.)"""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


class Tracker:
    """A best-effort MLflow run. Every method is a silent no-op once the tracker is disabled."""

    def __init__(self, tracking_uri: str | None = None, experiment: str = "aiayn",
                 enabled: bool = True) -> None:
        self.tracking_uri, self.experiment = resolve_tracking_uri(tracking_uri), experiment
        self._enabled, self._client, self._run_id = enabled, None, None

    @property
    def run_id(self) -> str | None:
        """The run's id (kept after ``end``); None when disabled or never started."""
        return self._run_id if self._enabled else None

    @property
    def active(self) -> bool:
        """True between a successful ``start`` and ``end`` (or the first failure)."""
        return self._enabled and self._run_id is not None and not self._ended

    def start(self, run_name: str | None, params: Mapping[str, Any],
              tags: dict[str, str] | None = None, run_id: str | None = None,
              child: str | None = None, variants: Collection[str] = ()) -> str | None:
        """Resume run ``run_id`` if it exists, else create a run named ``run_name``; or a child
        run of ``run_id`` where the scores to log are not its own: with ``child`` (a DVC
        experiment) if another experiment made it, else if it logged other values for some of
        ``variants`` (flattened keys of settings read after training), named for the settings
        it changed ("decode.beam=1"). Logs ``params`` flattened (those the run lacks), ``tags``,
        the git commit and DVC experiment. Returns the run id; None if disabled or failing."""
        if not self._enabled:
            return None
        if self.active:
            self.end()
        self._run_id, self._ended, self._session_start = None, False, _now_ms()
        self._found_end_time: int | None = None  # the end time of a run this process resumed
        configure()
        commit, experiment = git_commit(), default_run_name()
        tags = {**({"git_commit": commit, "mlflow.source.git.commit": commit} if commit else {}),
                **({"dvc_experiment": experiment} if experiment else {}), **(tags or {})}
        flat = {k: str(v) for k, v in flatten(dict(params)).items()}
        # Parallel experiments (`dvc queue start -j 2`) may all start on a fresh mlflow.db:
        # one process at a time creates (or migrates) the store and its experiment.
        with _store_lock(self.tracking_uri):
            try:
                from mlflow import MlflowClient
                from mlflow.utils import credentials, rest_utils

                if self.tracking_uri.startswith(("http://", "https://")):  # a server: is it up?
                    rest_utils.http_request_safe(
                        credentials.get_default_host_creds(self.tracking_uri),
                        "/api/2.0/mlflow/experiments/search", "POST", json={"max_results": 1},
                        **PROBE_LIMITS)
                self._client = _retry_locked(MlflowClient, self.tracking_uri)
            except Exception as e:
                self._disable(f"MLflow at {self.tracking_uri} is unreachable ({_short(e)})")
                return None
            try:
                self._open(self._client, run_name, flat, tags, run_id, child, variants)
            except Exception as e:
                self._fail("start", e)
                return None
        return self._run_id

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if not self.active or not metrics:
            return
        from mlflow.entities import Metric

        stamp, entries = int(time.time() * 1000), []
        for key, value in metrics.items():
            try:
                entries.append(Metric(key, float(value), stamp, int(step or 0)))
            except (TypeError, ValueError):
                log.debug("metric %s=%r is not a number; not sent to MLflow", key, value)
        self._call("log_metrics", self._client.log_batch, self._run_id, metrics=entries)

    def last_step(self, key: str) -> int | None:
        """The highest step the run holds for metric ``key``; None if none (or inactive)."""
        history = self.active and self._call("last_step", self._client.get_metric_history,
                                             self._run_id, key)
        return max((m.step for m in history or ()), default=None)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a file or (recursively) a folder into the run's artifacts."""
        path = Path(path)
        if self.active and not path.exists():
            log.warning("%s does not exist; not logged to MLflow", path)
        elif self.active:
            upload = self._client.log_artifacts if path.is_dir() else self._client.log_artifact
            self._call("log_artifact", upload, self._run_id, str(path), artifact_path)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        if self.active and tags:
            from mlflow.entities import RunTag

            self._call("set_tags", self._client.log_batch, self._run_id,
                       tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def end(self, status: str = "FINISHED", unchanged: bool = False) -> None:
        """Mark the run ``status`` (FINISHED, FAILED or KILLED). A run that had ended before this
        process resumed it ends at its old end plus this process's length (none if ``unchanged``:
        it added nothing): the UI's Duration sums its sessions, not the days between them."""
        if self.active:
            self._call("end", self._client.set_terminated, self._run_id, status,
                       self._end_time(unchanged))
            self._ended = True

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: object, tb: object) -> None:
        self.end("FINISHED" if exc_type is None else
                 "KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED")

    def _open(self, client: Any, run_name: str | None, flat: dict[str, str],
              tags: dict[str, str], run_id: str | None, child: str | None,
              variants: Collection[str]) -> None:
        """Find, resume or create the run that ``start`` describes; log its params and tags."""
        from mlflow.entities import Param, RunTag
        from mlflow.exceptions import MlflowException
        from mlflow.tracking.context.registry import resolve_tags
        from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        run, experiment_id = None, None
        try:
            run = run_id and _retry_locked(client.get_run, run_id)
        except MlflowException as e:
            if e.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                raise
        if run_id and (not run or run.info.lifecycle_stage == "deleted"):
            log.warning("MLflow run %s is not in %s (or was deleted); starting a new run",
                        run_id, self.tracking_uri)
            run = None
        if run and (child or variants):
            name = variant_name(run.data.params, flat, variants)
            mark = ("dvc_experiment", child) if child else (VARIANT_TAG, name) if name else None
            if mark and run.data.tags.get(mark[0]) != mark[1]:  # scores that are not its own
                parent, experiment_id = run.info.run_id, run.info.experiment_id
                found = _retry_locked(
                    client.search_runs, [experiment_id], max_results=1,
                    filter_string=f"tags.`{MLFLOW_PARENT_RUN_ID}` = '{parent}' and "
                                  f"tags.{mark[0]} = '{mark[1]}'")
                run = found[0] if found else None
                if not found:
                    log.info("MLflow: the scores of %s go to a child run of run %s",
                             f"experiment {child}" if child else name, parent)
                    tags = {**tags, MLFLOW_PARENT_RUN_ID: parent, mark[0]: mark[1]}
                    run_name = name or child
        if created := not run:
            run = _retry_locked(client.create_run, experiment_id or _retry_locked(
                self._experiment_id, client), run_name=run_name, tags=resolve_tags(tags))
        self._run_id = run.info.run_id
        if not created and run.info.status != "RUNNING":  # it had ended: this process resumes
            self._found_end_time = run.info.end_time
            _retry_locked(client.update_run, self._run_id, status="RUNNING")
        owner = run.data.tags.get("dvc_experiment")
        if not created and self._run_id == run_id and tags.get("dvc_experiment", owner) != owner:
            # Another experiment's train stage resumed it (a code change): it scores in a child.
            log.info("MLflow: run %s belongs to %s; %s resumes it without taking it over",
                     self._run_id, f"experiment {owner}" if owner else "the workspace",
                     tags.pop("dvc_experiment"))
        logged = run.data.params
        if changed := sorted(k for k, v in flat.items()
                             if k in logged and logged[k] != v[:MAX_PARAM_VAL_LENGTH]):
            log.warning("params changed since MLflow run %s started (%s); MLflow keeps the "
                        "first values", self._run_id, ", ".join(changed))
        _retry_locked(client.log_batch, self._run_id,
                      params=[Param(k, v) for k, v in flat.items() if k not in logged],
                      tags=[] if created else [RunTag(k, str(v)) for k, v in tags.items()])

    def _experiment_id(self, client: Any) -> str:
        """The experiment's id; created or restored as needed, tagged for the training view."""
        from mlflow.exceptions import MlflowException

        experiment = client.get_experiment_by_name(self.experiment)
        if experiment is None:
            try:
                return client.create_experiment(
                    self.experiment, tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND})
            except MlflowException:  # another process made it in between
                if (experiment := client.get_experiment_by_name(self.experiment)) is None:
                    raise
        if experiment.lifecycle_stage == "deleted":
            log.info("restoring the deleted MLflow experiment %r", self.experiment)
            client.restore_experiment(experiment.experiment_id)
        if experiment.tags.get(EXPERIMENT_KIND_TAG) is None:
            client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG,
                                      MODEL_TRAINING_KIND)
        return experiment.experiment_id

    def _end_time(self, unchanged: bool = False) -> int | None:
        """The end time ``end`` sets (None: now); see ``end``."""
        if self._found_end_time is None:
            return None
        return self._found_end_time + (0 if unchanged else max(0, _now_ms() - self._session_start))

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One MLflow call's result; None after any error, which disables (one warning)."""
        try:
            return _retry_locked(fn, *args, **kwargs)
        except Exception as e:
            self._fail(what, e)
            return None

    def _fail(self, what: str, error: BaseException) -> None:
        """Disable; the run ends FAILED as ``end`` would end it, if the store still answers."""
        client, run_id, end_time = self._client, self._run_id, self._end_time()
        self._disable(f"MLflow at {self.tracking_uri} failed in {what} ({_short(error)})")
        if client is not None and run_id is not None:
            with contextlib.suppress(Exception):
                client.set_terminated(run_id, "FAILED", end_time)

    def _disable(self, reason: str) -> None:
        log.warning("%s; training continues, the same numbers are in metrics/", reason)
        self._enabled, self._client = False, None


def log_into_run(run_file: Path, stage: str, metrics: Mapping[str, float] | None = None,
                 artifacts: Iterable[tuple[Path, str]] = (), tags: Mapping[str, str] | None = None,
                 params: Mapping[str, Any] | None = None) -> str | None:
    """Log a later stage's numbers and files into the training run that ``aiayn train`` saved
    in ``run_file`` (or a child run of it where ``params`` are not its own: Tracker.start).
    Returns the run id; None without a saved run for this store or where MLflow fails (the
    reason is logged once; the stage's own outputs are complete either way)."""
    tracker = Tracker()
    run_id = load_run_id(run_file, tracker.tracking_uri)
    if run_id is None:
        log.info("%s: no MLflow run id for %s in %s; not logging to MLflow", stage,
                 tracker.tracking_uri, run_file)
        return None
    experiment, params = default_run_name(), params or {}
    with tracker:  # should the training run be gone, the new run says so in its name
        if tracker.start(experiment or f"{stage} (run {run_id[:8]} is gone)", params,
                         run_id=run_id, child=experiment,
                         variants=[k for k in flatten(dict(params)) if after_training(k)]) is None:
            return None  # the tracker has said why (one warning)
        tracker.log_metrics(metrics or {})
        tracker.set_tags(tags or {})
        for path, artifact_path in artifacts:
            tracker.log_artifact(path, artifact_path)
    log.info("%s: logged to MLflow run %s", stage, tracker.run_id)
    return tracker.run_id


def _now_ms() -> int:
    """Wall-clock time in milliseconds since the epoch, as MLflow stores run times."""
    return int(time.time() * 1000)


# SQLite has one writer at a time: parallel experiments retry "database is locked" (~25 s).
_LOCKED_DELAYS = (0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 6.4, 6.4)


def _retry_locked(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, tried again while SQLite says the database is locked."""
    for delay in _LOCKED_DELAYS:
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            if "database is locked" not in str(e) and "database table is locked" not in str(e):
                raise
            log.debug("MLflow's SQLite store is locked; trying again in %.1f s", delay)
            time.sleep(delay)
    return fn(*args, **kwargs)


def _store_lock(tracking_uri: str) -> AbstractContextManager:
    """An exclusive lock on ``<db>.lock`` beside a SQLite store, released as the file closes
    (none for a server, nor off POSIX: SQLite's own locking and the retries only)."""
    db = sqlite_path(tracking_uri)
    if db is None or db.name in ("", ":memory:") or os.name != "posix":
        return contextlib.nullcontext()
    import fcntl

    db.parent.mkdir(parents=True, exist_ok=True)
    lock = open(db.with_name(db.name + ".lock"), "a")  # the caller closes it
    fcntl.flock(lock, fcntl.LOCK_EX)
    return lock


def _short(error: BaseException) -> str:
    """One line of an exception's text (MLflow's can span screens): of urllib3's, the cause."""
    text = " ".join(str(error).split()) or type(error).__name__
    if found := re.search(r"\[Errno -?\d+\][^'\")]*|\w+ timed out\. \(\w+ timeout=[\d.]+\)", text):
        return found.group(0).strip()
    return text if len(text) <= 300 else text[:297] + "..."
