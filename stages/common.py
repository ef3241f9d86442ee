"""What every stage command shares: the --params option, error reporting, logging."""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, TypeVar

import typer

from aiayn.config import Params, load_params
from aiayn.errors import AiaynError

ParamsPath = Annotated[
    Path,
    typer.Option(
        "--params", "-p",
        help="Parameters file (validated against aiayn.config before any work).",
        show_default=True,
    ),
]

F = TypeVar("F", bound=Callable)
log = logging.getLogger("aiayn")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (a test runner or notebook may swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


class _Formatter(logging.Formatter):
    """``12:00:00 aiayn: message``; a warning says so: ``12:00:00 aiayn: warning:
    message``, so that it stands out among the progress lines (and a script can find it)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(name)s: %(message)s", "%H:%M:%S")
        self._loud = logging.Formatter("%(asctime)s %(name)s: warning: %(message)s", "%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        return self._loud.format(record) if record.levelno >= logging.WARNING \
            else super().format(record)


def setup_logging() -> None:
    if not log.handlers:
        handler = _StderrHandler()
        handler.setFormatter(_Formatter())
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def stage(fn: F) -> F:
    """Wrap a stage command: user errors print one clear message and exit non-zero."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        setup_logging()
        start = time.perf_counter()
        try:
            result = fn(*args, **kwargs)
        except AiaynError as exc:
            typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=exc.exit_code) from None
        except KeyboardInterrupt:
            typer.secho("interrupted; outputs were left as they were", err=True)
            raise typer.Exit(code=130) from None
        log.info("%s done in %.1f s", fn.__name__.removesuffix("_command"),
                 time.perf_counter() - start)
        return result

    return wrapper  # type: ignore[return-value]


def read_params(path: Path) -> Params:
    return load_params(path)


def single_command_app(command: Callable, help_text: str) -> typer.Typer:
    """A Typer app holding one stage command, for `python -m stages.<name>`."""
    app = typer.Typer(add_completion=False, help=help_text, pretty_exceptions_enable=False,
                      rich_markup_mode="markdown")
    app.command()(command)
    return app
