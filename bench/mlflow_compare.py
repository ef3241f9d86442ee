"""Screenshot the MLflow UI's compare view of DVC experiments, in a real headless browser.

Usage (in the repository that ran the experiments; ``pip install playwright`` and a
Chromium, e.g. Debian's ``apt install chromium``)::

    python -m bench.mlflow_compare bf16-ls0.2-3009steps bf16-ls0.3-3009steps \\
        --param train.label_smoothing --metric final_valid/sacrebleu --metric valid/nll \\
        --out docs/results/multi30k/bf16-ls-sweep/mlflow_compare.png

Each NAME is a DVC experiment name (``dvc exp run -n NAME``): the training logs its MLflow
run under that name, tagged ``dvc_experiment``. A decoding or averaging experiment that
reused a training is a child run of it, named for the settings it changed and tagged with
NAME. The script starts ``mlflow server`` on the tracking store (``local_server``), opens
``#/compare-runs`` of those runs, closes the assistant panel, sets the parallel-coordinates
plot's axes to --param and --metric when given (otherwise MLflow's own choice), switches the
parameter and metric tables to "show diff only", and writes one PNG. The server stops
afterwards; the store is only read.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

from aiayn.io import atomic_path
from aiayn.tracking import resolve_tracking_uri, sqlite_path
from bench import harness


class CompareError(RuntimeError):
    """A problem the user can fix (unknown name, no server, no browser): no traceback."""


class ServerError(RuntimeError):
    """``mlflow server`` exited or did not answer in time (the message ends with its log)."""


@contextlib.contextmanager
def local_server(backend_store_uri: str, artifact_root: Path | None = None,
                 cwd: Path | None = None, timeout: float = 60) -> Iterator[str]:
    """Run ``mlflow server`` on the store, on a free 127.0.0.1 port; yield its address.

    One worker and job execution off (``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false``): it
    starts in seconds. Raises ``ServerError`` with the tail of the server's log if it exits
    or does not answer ``/health`` within ``timeout`` s; stops the server on exit. (The
    tests' MLflow server is this one too.)
    """
    with socket.socket() as s:  # a port nothing listens on now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = Path(sys.executable).with_name("mlflow")
    cmd = [str(exe) if exe.exists() else "mlflow", "server", "--host", "127.0.0.1",
           "--port", str(port), "--backend-store-uri", backend_store_uri, "--workers", "1"]
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


def find_runs(tracking_uri: str, experiment: str, names: list[str]) -> list:
    """The MLflow run of each DVC experiment NAME, in the order given.

    A run belongs to NAME when its ``dvc_experiment`` tag or its run name is NAME; of
    several (a name reused), the latest started one is taken.
    """
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        known = ", ".join(e.name for e in client.search_experiments()) or "none"
        raise CompareError(f"{tracking_uri}: no MLflow experiment '{experiment}' "
                           f"(experiments there: {known}); pick one with --experiment")
    runs, missing = [], []
    for name in names:
        quoted = name.replace("'", "\\'")
        found = []
        for where in (f"tags.dvc_experiment = '{quoted}'", f"attributes.run_name = '{quoted}'"):
            found = client.search_runs([exp.experiment_id], filter_string=where,
                                       order_by=["attributes.start_time DESC"], max_results=1)
            if found:
                break
        if found:
            runs.append(found[0])
        else:
            missing.append(name)
    if missing:
        known = sorted({r.info.run_name for r in client.search_runs(
            [exp.experiment_id], max_results=1000) if r.info.run_name})
        raise CompareError(
            f"{tracking_uri}, experiment '{experiment}': no run named {', '.join(missing)} "
            f"(no run with that dvc_experiment tag or run name). Runs there: "
            f"{', '.join(known) or 'none'}")
    return runs


def compare_url(base: str, run_ids: list[str], experiment_ids: list[str]) -> str:
    """The MLflow UI's compare-runs address of these runs."""
    runs = quote(json.dumps(run_ids, separators=(",", ":")))
    experiments = quote(json.dumps(sorted(set(experiment_ids)), separators=(",", ":")))
    return f"{base.rstrip('/')}/#/compare-runs?runs={runs}&experiments={experiments}"


def _choose(page, index: int, wanted: list[str]) -> None:
    """Set the plot's parameter (index 0) or metric (index 1) select to exactly WANTED."""
    select = page.locator(".du-bois-light-select").nth(index)
    for name in wanted:
        select.click()
        page.keyboard.type(name)  # the list is virtual: filter it to the one wanted
        option = page.locator(f".du-bois-light-select-item-option[title='{name}']")
        if option.count() == 0:
            shown = page.locator(".du-bois-light-select-item-option").all_inner_texts()
            kind = "parameter" if index == 0 else "metric"
            raise CompareError(f"the compare view offers no {kind} '{name}' "
                               f"(it offers: {', '.join(shown)})")
        option.first.click()
        page.keyboard.press("Escape")


def screenshot(url: str, out: Path, run_names: list[str], params: list[str], metrics: list[str],
               chromium: str | None, width: int, height: int) -> None:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:
        raise CompareError("this script drives a browser with Playwright: pip install "
                           "playwright (and a Chromium: apt install chromium, or playwright "
                           "install chromium)") from e
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.goto(url)
            # The UI polls, so the network never idles: wait for the runs' names instead.
            for name in run_names:
                page.get_by_text(name, exact=True).first.wait_for(timeout=90_000)
            close = page.get_by_role("button", name="Close")
            if close.count():
                close.first.click()
            if params or metrics:
                page.get_by_role("button", name="Clear All").click()
                _choose(page, 0, params)
                _choose(page, 1, metrics)
            for table in ("Parameters", "Metrics"):
                switch = page.get_by_label(f"{table} - Show diff only")
                if switch.count():
                    switch.first.click()
            page.mouse.move(0, 0)
            time.sleep(2)  # the plot redraws after each change
            png = page.screenshot(type="png")
            with atomic_path(out) as tmp:  # whole or not at all, with ordinary permissions
                tmp.write_bytes(png)
        finally:
            browser.close()


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, epilog=True)
    ap.add_argument("names", nargs="+", help="DVC experiment names (their MLflow runs' names)")
    ap.add_argument("--tracking-uri", default=None,
                    help="the MLflow store the runs are in (default: the stages' own choice, "
                         "$MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
    ap.add_argument("--experiment", default="aiayn", help="MLflow experiment (default: aiayn)")
    ap.add_argument("--param", action="append", default=[], metavar="NAME",
                    help="a parameter axis of the plot, e.g. train.label_smoothing (repeat)")
    ap.add_argument("--metric", action="append", default=[], metavar="NAME",
                    help="a metric axis of the plot, e.g. final_valid/sacrebleu (repeat)")
    ap.add_argument("--out", type=Path, default=Path("mlflow_compare.png"), help="PNG written")
    ap.add_argument("--chromium",
                    default=shutil.which("chromium") or shutil.which("chromium-browser"),
                    help="browser binary (default: chromium on PATH, else Playwright's own)")
    ap.add_argument("--width", type=int, default=1600, help="viewport width in pixels")
    ap.add_argument("--height", type=int, default=2000, help="viewport height in pixels")
    a = ap.parse_args(argv)
    a.tracking_uri = resolve_tracking_uri(a.tracking_uri)
    if (db := sqlite_path(a.tracking_uri)) is not None:
        if not db.is_file():
            print(f"error: {db}: no MLflow store there; pass --tracking-uri", file=sys.stderr)
            return 2
        # The server runs in a temporary folder: make a relative store path absolute.
        a.tracking_uri = "sqlite:///" + str(db.resolve())
    try:
        runs = find_runs(a.tracking_uri, a.experiment, a.names)
        with local_server(a.tracking_uri, timeout=90) as base:
            url = compare_url(base, [r.info.run_id for r in runs],
                              [r.info.experiment_id for r in runs])
            print(f"compare view: {url}", file=sys.stderr)
            screenshot(url, a.out, [r.info.run_name for r in runs], a.param, a.metric,
                       a.chromium, a.width, a.height)
    except (CompareError, ServerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.out} ({len(runs)} runs: {', '.join(a.names)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
