"""The one door to MLflow: params, metrics, tags and artifacts, and nothing that stops training.

``Tracker`` wraps ``mlflow.MlflowClient`` with explicit run ids (never the fluent, global
active run), so it does not interfere with other code and can live on rank 0 of a torchrun
job while the other ranks hold ``Tracker(enabled=False)``. MLflow is a mirror: every number
also goes to ``metrics/`` (DVC metrics in git), so a tracking server that is down or an MLflow
call that raises costs one warning and turns the tracker off; it never raises and never hangs
for minutes.

MLflow's HTTP client retries with exponential backoff for minutes by default. The tracker
gives its calls tight limits instead (``_PROBE_ENV`` for the reachability probe and the
start, ``_CALL_ENV`` afterwards), applied only around its own calls and only for the
variables a user has not set, so explicit ``MLFLOW_HTTP_REQUEST_*`` settings always win and
nothing is left changed in the environment.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import warnings
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from aiayn.config import after_training
from aiayn.io import write_json

log = logging.getLogger("aiayn")

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
# MLflow 3's UI opens an experiment in its model-training view (runs, metrics, charts) or in
# its GenAI view (traces, evaluations) by this experiment tag; without it, the UI guesses.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING_KIND = "custom_model_development"

# MLflow's limits (mlflow.utils.validation): per log_batch call and per value.
_MAX_PARAMS_PER_BATCH = 100
_MAX_TAGS_PER_BATCH = 100
_MAX_METRICS_PER_BATCH = 1000
_MAX_PARAM_VALUE = 6000
_MAX_TAG_VALUE = 8000

# Reachability probe and start: give up within seconds (worst case, a host that drops
# packets: 2 tries x 3 s + a ~1-2 s backoff; a refused connection: about 1-2 s).
_PROBE_ENV = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "3",
}
# Later calls, against a server that answered: ride out a blip, but a server that dies
# mid-training stalls it once for well under two minutes (3 tries x 30 s), not ~4 minutes
# per call as with MLflow's defaults.
_CALL_ENV = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}

def resolve_tracking_uri(tracking_uri: str | None = None) -> str:
    """The given URI, else ``$MLFLOW_TRACKING_URI``, else the project's SQLite store.

    The project's store is ``mlflow.db`` in the DVC repository's root when a stage runs
    under DVC: DVC sets ``$DVC_ROOT`` to the user's repository, also for queued experiments
    that run in a temporary copy (whose own ``mlflow.db`` would vanish with it). Run by
    hand, outside DVC, a stage uses ``mlflow.db`` in the current directory.
    """
    if tracking_uri:
        return tracking_uri
    if env_uri := os.environ.get("MLFLOW_TRACKING_URI"):
        return env_uri
    if dvc_root := os.environ.get("DVC_ROOT"):
        return f"sqlite:///{Path(dvc_root).resolve() / 'mlflow.db'}"
    return DEFAULT_TRACKING_URI


def default_run_name() -> str | None:
    """The DVC experiment's name under ``dvc exp run``; else None."""
    return os.environ.get("DVC_EXP_NAME") or None


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"model": {"d_model": 512}}`` -> ``{"model.d_model": "512"}``, values as MLflow keeps them.

    Values are stringified and truncated to MLflow's limit; lists stay one value; an empty
    mapping is kept as ``"{}"`` so that the key still shows.
    """
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_params(value, prefix=f"{name}."))
        else:
            flat[name] = _truncate(str(value), _MAX_PARAM_VALUE)
    return flat


def save_run_id(path: Path, run_id: str | None, tracking_uri: str | None = None) -> None:
    """Record the run id (and where it lives) so that a restarted stage can resume the run."""
    write_json(path, {"run_id": run_id, "tracking_uri": resolve_tracking_uri(tracking_uri)})


def load_run_id(path: Path, tracking_uri: str | None = None) -> str | None:
    """The run id saved at ``path``; None if the file is missing or unreadable.

    With ``tracking_uri`` given, a run id saved for another tracking URI is not returned
    (it would name no run there).
    """
    path = Path(path)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        log.warning("%s is unreadable (%s); starting a new MLflow run", path, e)
        return None
    if not isinstance(data, dict):
        log.warning("%s holds no run id; starting a new MLflow run", path)
        return None
    run_id = data.get("run_id")
    saved_uri = data.get("tracking_uri")
    if tracking_uri is not None and saved_uri and not same_store(saved_uri, tracking_uri):
        return None
    return run_id if isinstance(run_id, str) and run_id else None


# The tag of a child run that holds the scores of other decoding or averaging settings than
# its training run's, made by `dvc repro` (an experiment's child runs carry dvc_experiment).
VARIANT_TAG = "aiayn_variant"


def variant_name(logged: Mapping[str, str], flat: Mapping[str, str],
                 keys: Collection[str]) -> str | None:
    """The settings among ``keys`` whose value in ``flat`` differs from the one a run
    ``logged`` (keys it never logged do not count), as a run name ("decode.beam=1,
    decode.alpha=1.0"); None where none differs."""
    changed = [f"{k}={flat[k]}" for k in sorted(keys)
               if k in flat and k in logged and logged[k] != flat[k]]
    return _truncate(", ".join(changed).replace("'", ""), 250) if changed else None


def same_store(a: str, b: str) -> bool:
    """Whether two tracking URIs name one store: equal, or SQLite URIs of one database file
    (``sqlite:///mlflow.db`` run in the repository and the absolute URI a DVC stage saved)."""
    if a == b:
        return True
    pa, pb = sqlite_path(a), sqlite_path(b)
    return pa is not None and pb is not None and pa.resolve() == pb.resolve()


class Tracker:
    """A best-effort MLflow run. Every method is a silent no-op once the tracker is disabled."""

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str = "aiayn",
        enabled: bool = True,
    ) -> None:
        self.tracking_uri = resolve_tracking_uri(tracking_uri)
        self.experiment = experiment
        self._enabled = enabled
        self._client: Any = None
        self._run_id: str | None = None
        self._ended = False
        self._found_end_time: int | None = None
        self._session_start: int | None = None

    # -- state -------------------------------------------------------------------------------

    @property
    def run_id(self) -> str | None:
        """The run's id (kept after ``end``); None when disabled or never started."""
        return self._run_id if self._enabled else None

    @property
    def active(self) -> bool:
        """True between a successful ``start`` and ``end`` (or the first failure)."""
        return self._enabled and self._run_id is not None and not self._ended

    # -- the run -----------------------------------------------------------------------------

    def start(
        self,
        run_name: str | None,
        params: Mapping[str, Any],
        tags: dict[str, str] | None = None,
        run_id: str | None = None,
        child: str | None = None,
        variants: Collection[str] = (),
    ) -> str | None:
        """Resume run ``run_id`` if it exists, else create a run named ``run_name``.

        With ``child`` (a DVC experiment's name) and a run ``run_id`` made by another
        experiment, the run started is instead the child run of ``run_id`` named ``child``
        (found again by later stages of the same experiment): an experiment that changes
        only decoding or averaging reuses the training run's checkpoints, but its scores are
        its own and must not overwrite the training run's. Without ``child`` (`dvc repro`, no
        experiment), ``variants`` names the settings (flattened keys) that do not shape
        training: where the run ``run_id`` logged other values for some of them, the run
        started is its child run named after the new values (`dvc repro` after a change of
        decode.beam: a score of other settings than the training run's). Logs ``params``
        flattened (on resume, only the keys the run does not have yet) and ``tags`` plus the
        git commit and the DVC experiment name. Returns the run id, or None when disabled or
        MLflow is unreachable.
        """
        if not self._enabled:
            return None
        if self.active:
            self.end()
        self._run_id = None
        self._ended = False
        self._found_end_time = None
        self._session_start = _now_ms()
        # One process at a time creates (or migrates) a SQLite store and its experiment:
        # parallel experiments (`dvc queue start -j 2`) may all start on a fresh mlflow.db.
        with _store_lock(self.tracking_uri):
            try:
                with _mlflow_env(_PROBE_ENV):
                    client = self._connect()
                    # The probe: the first real request, with the tight limits.
                    _retry_locked(client.search_experiments, max_results=1)
            except Exception as e:
                self._disable(f"MLflow at {self.tracking_uri} is unreachable ({_short(e)})")
                return None
            try:
                with _mlflow_env(_PROBE_ENV):
                    run = (_retry_locked(self._resume, client, run_id,
                                         reopen=not (child or variants)) if run_id else None)
                    if run is not None and child:
                        run = _retry_locked(self._child_of, client, run, child)
                    elif run is not None and variants:
                        name = variant_name(run.data.params, flatten_params(params), variants)
                        if name:
                            run = _retry_locked(self._child_of, client, run, name,
                                                VARIANT_TAG)
                        elif run.info.status != "RUNNING":
                            _retry_locked(client.update_run, run.info.run_id, status="RUNNING")
                    if run is None:
                        run = _retry_locked(client.create_run, _retry_locked(
                            self._experiment_id, client), run_name=run_name)
                    self._client = client
                    self._run_id = run.info.run_id
                    if run_id and run.info.status != "RUNNING":  # it had ended: resumed
                        self._found_end_time = run.info.end_time
                    _retry_locked(self._log_params, run, flatten_params(params))
                    new_tags = {**_default_tags(), **(tags or {})}
                    owner = run.data.tags.get("dvc_experiment")
                    resumed = run_id is not None and run.info.run_id == run_id
                    if resumed and new_tags.get("dvc_experiment", owner) != owner:
                        # A run belongs to the experiment that made it, or to the workspace
                        # (`dvc repro`: no experiment). Another one that resumes it (its
                        # train stage re-ran on the same checkpoints, e.g. after a code
                        # change, and found the training finished) must not take it over:
                        # its later stages would then log their scores into this run
                        # instead of a child run of it.
                        log.info("MLflow: run %s belongs to %s; %s resumes it without "
                                 "taking it over", self._run_id,
                                 f"experiment {owner}" if owner else "the workspace",
                                 new_tags["dvc_experiment"])
                        del new_tags["dvc_experiment"]
                    _retry_locked(self._log_tags, new_tags)
            except Exception as e:
                self._fail("start", e)
                return None
        return self._run_id

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if not self.active or not metrics:
            return
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        entries = []
        for key, value in metrics.items():
            try:
                entries.append(Metric(key, float(value), stamp, int(step or 0)))
            except (TypeError, ValueError):
                log.debug("metric %s=%r is not a number; not sent to MLflow", key, value)
        for i in range(0, len(entries), _MAX_METRICS_PER_BATCH):
            chunk = entries[i : i + _MAX_METRICS_PER_BATCH]
            if not self._call("log_metrics", self._client.log_batch, self._run_id, metrics=chunk):
                return

    def last_step(self, key: str) -> int | None:
        """The highest step the run holds for metric ``key``; None if none (or inactive)."""
        if not self.active:
            return None
        try:
            with _mlflow_env(_CALL_ENV):
                history = _retry_locked(self._client.get_metric_history, self._run_id, key)
        except Exception as e:
            self._fail("last_step", e)
            return None
        return max((m.step for m in history), default=None)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a file or (recursively) a folder into the run's artifacts."""
        if not self.active:
            return
        path = Path(path)
        if not path.exists():
            log.warning("%s does not exist; not logged to MLflow", path)
            return
        upload = self._client.log_artifacts if path.is_dir() else self._client.log_artifact
        self._call("log_artifact", upload, self._run_id, str(path), artifact_path)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        if not self.active or not tags:
            return
        try:
            _retry_locked(self._log_tags, dict(tags))
        except Exception as e:
            self._fail("set_tags", e)

    def end(self, status: str = "FINISHED", unchanged: bool = False) -> None:
        """Mark the run ``status`` (FINISHED, FAILED or KILLED); the run id stays readable.

        A run that had ended before this session resumed it (a later stage, a re-run
        ``score``, a training resumed after a failure) ends at its old end time plus this
        session's own length: the MLflow UI's Duration adds up the time its sessions worked,
        not the hours or days between them. Run back to back, as ``dvc repro`` runs the
        stages, that is the time of the last stage's end. ``unchanged``: this session added
        nothing (a train stage that found the training finished), so the run keeps its end
        time as it was.
        """
        if not self.active:
            return
        self._call("end", self._client.set_terminated, self._run_id, status,
                   self._end_time(unchanged))
        self._ended = True

    def _end_time(self, unchanged: bool = False) -> int | None:
        """The end time ``end`` sets (None: now); see ``end``."""
        if self._found_end_time is None:
            return None
        worked = 0 if unchanged else max(0, _now_ms() - (self._session_start or 0))
        return self._found_end_time + worked

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: object, tb: object) -> None:
        if exc_type is None:
            self.end("FINISHED")
        elif issubclass(exc_type, KeyboardInterrupt):
            self.end("KILLED")
        else:
            self.end("FAILED")

    # -- internals ---------------------------------------------------------------------------

    def _connect(self) -> Any:
        _quiet_mlflow()
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.tracking_uri)

    def _experiment_id(self, client: Any) -> str:
        from mlflow.exceptions import MlflowException

        experiment = client.get_experiment_by_name(self.experiment)
        if experiment is None:
            try:
                return client.create_experiment(
                    self.experiment, tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND})
            except MlflowException:
                # Another process created it in between.
                experiment = client.get_experiment_by_name(self.experiment)
                if experiment is None:
                    raise
        if experiment.lifecycle_stage == "deleted":
            log.info("restoring the deleted MLflow experiment %r", self.experiment)
            client.restore_experiment(experiment.experiment_id)
        if experiment.tags.get(EXPERIMENT_KIND_TAG) is None:
            client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG,
                                      MODEL_TRAINING_KIND)
        return experiment.experiment_id

    def _resume(self, client: Any, run_id: str, reopen: bool = True) -> Any:
        """The run ``run_id`` (set back to RUNNING if ``reopen``), or None if there is no
        such (live) run."""
        from mlflow.exceptions import MlflowException

        try:
            run = client.get_run(run_id)
        except MlflowException as e:
            if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                log.info("MLflow run %s not found at %s; starting a new run",
                         run_id, self.tracking_uri)
                return None
            raise
        if run.info.lifecycle_stage == "deleted":
            log.info("MLflow run %s was deleted; starting a new run", run_id)
            return None
        if reopen and run.info.status != "RUNNING":
            client.update_run(run_id, status="RUNNING")
        return run

    def _child_of(self, client: Any, parent: Any, name: str,
                  tag: str = "dvc_experiment") -> Any:
        """``parent`` itself if its ``tag`` is ``name`` (experiment ``name`` made it), else
        its child run ``name``, tagged so."""
        parent_id = parent.info.run_id
        if parent.data.tags.get(tag) == name:
            if parent.info.status != "RUNNING":
                client.update_run(parent_id, status="RUNNING")
            return parent
        found = client.search_runs(
            [parent.info.experiment_id], max_results=1,
            filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}' and "
                          f"tags.{tag} = '{name}'")
        if found:
            run = found[0]
            if run.info.status != "RUNNING":
                client.update_run(run.info.run_id, status="RUNNING")
            return run
        if tag == VARIANT_TAG:
            log.info("MLflow: settings of run %s changed (%s); these scores go to a child run "
                     "of it", parent_id, name)
        else:
            log.info("MLflow: experiment %s reuses the training of run %s; its scores go to "
                     "a child run of it", name, parent_id)
        return client.create_run(parent.info.experiment_id, run_name=name,
                                 tags={"mlflow.parentRunId": parent_id, tag: name})

    def _log_params(self, run: Any, flat: dict[str, str]) -> None:
        from mlflow.entities import Param

        existing: dict[str, str] = dict(run.data.params)
        changed = sorted(k for k, v in flat.items() if k in existing and existing[k] != v)
        if changed:
            shown = ", ".join(changed[:10]) + (", ..." if len(changed) > 10 else "")
            log.warning(
                "params changed since MLflow run %s started (%s); MLflow keeps the first values",
                self._run_id, shown,
            )
        todo = [Param(k, v) for k, v in flat.items() if k not in existing]
        for i in range(0, len(todo), _MAX_PARAMS_PER_BATCH):
            self._client.log_batch(self._run_id, params=todo[i : i + _MAX_PARAMS_PER_BATCH])

    def _log_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        entries = [RunTag(k, _truncate(str(v), _MAX_TAG_VALUE)) for k, v in tags.items()]
        for i in range(0, len(entries), _MAX_TAGS_PER_BATCH):
            chunk = entries[i : i + _MAX_TAGS_PER_BATCH]
            with _mlflow_env(_CALL_ENV):
                self._client.log_batch(self._run_id, tags=chunk)

    def _call(self, what: str, fn: Callable[..., object], *args: Any, **kwargs: Any) -> bool:
        """Run one MLflow call; on any error warn once, disable, and return False."""
        try:
            with _mlflow_env(_CALL_ENV):
                _retry_locked(fn, *args, **kwargs)
        except Exception as e:
            self._fail(what, e)
            return False
        return True

    def _fail(self, what: str, error: BaseException) -> None:
        client, run_id = self._client, self._run_id
        # A resumed run that fails ends as ``end`` would end it: the UI's Duration must not
        # count the time between the sessions because this one failed.
        end_time = self._end_time()
        self._disable(f"MLflow at {self.tracking_uri} failed in {what} ({_short(error)})")
        # Best effort: do not leave the run RUNNING forever if the server still answers.
        if client is not None and run_id is not None:
            with contextlib.suppress(Exception), _mlflow_env(_PROBE_ENV):
                client.set_terminated(run_id, "FAILED", end_time)

    def _disable(self, reason: str) -> None:
        log.warning("%s; training continues, the same numbers are in metrics/", reason)
        self._enabled = False
        self._client = None


def log_into_run(run_file: Path, stage: str, metrics: Mapping[str, float] | None = None,
                 artifacts: Iterable[tuple[Path, str]] = (),
                 tags: Mapping[str, str] | None = None,
                 params: Mapping[str, Any] | None = None) -> str | None:
    """Log a later stage's numbers and files into the training run named in ``run_file``.

    One pipeline execution is one MLflow run: ``aiayn train`` creates it and saves its id
    next to the checkpoints; average, translate and score add to it. A DVC experiment that
    did not train (it changed only decoding or averaging, so DVC reused the checkpoints of
    another) logs into a child run of that training run, named after it, with ``params``
    (see Tracker.start). Returns the run id, or None when there is no saved run for this
    tracking URI or MLflow is unreachable (the reason is logged once; the stage's own
    outputs are complete either way).
    """
    tracker = Tracker()
    run_id = load_run_id(run_file, tracker.tracking_uri)
    if run_id is None:
        log.info("%s: no MLflow run id for %s in %s; not logging to MLflow", stage,
                 tracker.tracking_uri, run_file)
        return None
    experiment = default_run_name()
    # Under `dvc repro` (no experiment), scores of changed decoding or averaging settings go
    # to a child run named after them, not over the training run's own.
    variants = ([] if experiment else
                [k for k in flatten_params(params or {}) if after_training(k)])
    with tracker:
        if tracker.start(run_name=experiment, params=params or {}, run_id=run_id,
                         child=experiment, variants=variants) is None:
            return None  # the tracker has said why (one warning)
        if experiment is None and tracker.run_id != run_id:
            log.warning("%s: MLflow run %s is gone; logged into a new run %s", stage, run_id,
                        tracker.run_id)
        tracker.log_metrics(metrics or {})
        tracker.set_tags(tags or {})
        for path, artifact_path in artifacts:
            tracker.log_artifact(path, artifact_path)
    log.info("%s: logged to MLflow run %s", stage, tracker.run_id)
    return tracker.run_id


def _now_ms() -> int:
    """Wall-clock time in milliseconds since the epoch, as MLflow stores run times."""
    return int(time.time() * 1000)


def _default_tags() -> dict[str, str]:
    tags: dict[str, str] = {}
    commit = git_commit()
    if commit:
        tags["git_commit"] = commit
        tags["mlflow.source.git.commit"] = commit  # shown by the MLflow UI
    experiment = default_run_name()
    if experiment:
        tags["dvc_experiment"] = experiment
    return tags


def git_commit(cwd: str | Path | None = None) -> str | None:
    """``git rev-parse HEAD`` in ``cwd`` (default: the current directory), or None."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and commit else None


# SQLite allows one writer at a time; a writer that waits longer than SQLAlchemy's timeout
# gets "database is locked". Parallel experiments on one mlflow.db retry instead: up to
# ~25 s in all, then the usual warning.
_LOCKED_DELAYS = (0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 6.4, 6.4)


def _is_locked(error: BaseException) -> bool:
    return "database is locked" in str(error) or "database table is locked" in str(error)


def _retry_locked(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, tried again while SQLite says the database is locked."""
    for delay in _LOCKED_DELAYS:
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            if not _is_locked(e):
                raise
            log.debug("MLflow's SQLite store is locked; trying again in %.1f s", delay)
            time.sleep(delay)
    return fn(*args, **kwargs)


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` tracking URI; None for other stores."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    return Path(tracking_uri.removeprefix("sqlite:///").split("?", 1)[0])


class ServerError(RuntimeError):
    """``mlflow server`` exited or did not answer in time (the message ends with its log)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_server(backend_store_uri: str, artifact_root: Path | None = None,
                 cwd: Path | None = None, timeout: float = 60) -> Iterator[str]:
    """Run ``mlflow server`` on the store, on a free 127.0.0.1 port; yield its address.

    One worker and job execution off (``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false``): it
    starts in seconds. Raises ``ServerError`` with the tail of the server's log if it exits
    or does not answer ``/health`` within ``timeout`` s; stops the server on exit.
    """
    exe = Path(sys.executable).with_name("mlflow")
    cmd = [str(exe) if exe.exists() else "mlflow", "server", "--host", "127.0.0.1",
           "--port", str(port := free_port()), "--backend-store-uri", backend_store_uri,
           "--workers", "1"]
    if artifact_root is not None:
        cmd += ["--default-artifact-root", str(artifact_root)]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with tempfile.TemporaryDirectory(prefix="aiayn-mlflow-server-") as tmp:
        log_path = Path(tmp) / "server.log"
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(cmd, cwd=cwd or tmp, env=env, stdout=log_file,
                                    stderr=subprocess.STDOUT)
            try:
                address = f"http://127.0.0.1:{port}"
                deadline = time.monotonic() + timeout
                while True:
                    if proc.poll() is not None:
                        raise ServerError(f"mlflow server exited ({proc.returncode}):\n"
                                          + log_path.read_text(errors="replace")[-3000:])
                    try:
                        with urllib.request.urlopen(address + "/health", timeout=2) as r:
                            if r.status == 200:
                                break
                    except OSError:
                        pass
                    if time.monotonic() > deadline:
                        raise ServerError(f"mlflow server not up in {timeout:.0f} s:\n"
                                          + log_path.read_text(errors="replace")[-3000:])
                    time.sleep(0.5)
                yield address
            finally:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@contextlib.contextmanager
def _store_lock(tracking_uri: str) -> Iterator[None]:
    """An exclusive lock on ``<db>.lock`` beside a SQLite store (nothing for a server)."""
    db = sqlite_path(tracking_uri)
    try:
        import fcntl
    except ImportError:  # not POSIX: SQLite's own locking and the retries only
        fcntl = None
    if db is None or db.name in ("", ":memory:") or fcntl is None:
        yield
        return

    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def _mlflow_env(defaults: dict[str, str]) -> Iterator[None]:
    """Set ``defaults`` for the variables the user has not set; restore on exit; hush warnings.

    MLflow reads its ``MLFLOW_HTTP_REQUEST_*`` variables at every request, so limits set only
    around our calls take effect without changing the environment for anyone else.
    """
    added = [k for k in defaults if k not in os.environ]
    for k in added:
        os.environ[k] = defaults[k]
    # urllib3 logs each retry as a WARNING; the tracker says it once, in its own words.
    pool_log = logging.getLogger("urllib3.connectionpool")
    hush = _drop not in pool_log.filters  # not already hushed by an enclosing call
    if hush:
        pool_log.addFilter(_drop)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        if hush:
            pool_log.removeFilter(_drop)
        for k in added:
            os.environ.pop(k, None)


def _drop(record: logging.LogRecord) -> bool:
    return False


_quieted = False


def _quiet_mlflow() -> None:
    """MLflow's INFO chatter (database migrations, "View run at ...") off the console."""
    global _quieted
    if _quieted:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import mlflow  # noqa: F401  (configures mlflow's own loggers on import)
    if not os.environ.get("MLFLOW_LOGGING_LEVEL"):
        for name in ("mlflow", "alembic"):
            logger = logging.getLogger(name)
            if logger.getEffectiveLevel() < logging.WARNING:
                logger.setLevel(logging.WARNING)
    _quieted = True


def _short(error: BaseException) -> str:
    """One line of an exception's text (MLflow's can span screens)."""
    text = " ".join(str(error).split()) or type(error).__name__
    for pattern in _CAUSES:
        found = re.search(pattern, text)
        if found:
            return found.group(0).strip()
    return _truncate(text, 300)


# The informative part of urllib3's "Max retries exceeded ... (Caused by ...)" texts.
_CAUSES = (
    r"\[Errno -?\d+\][^'\")]*",  # [Errno 111] Connection refused
    r"Read timed out\. \(read timeout=[\d.]+\)",
    r"timed out\. \(connect timeout=[\d.]+\)",
)


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
