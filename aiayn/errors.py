"""Errors meant for the person running a stage.

An ``AiaynError`` says what went wrong, where (file, line, key) and how to fix it. The stage
commands print its message without a traceback and exit non-zero; anything else is a bug
and keeps its traceback.
"""


class AiaynError(Exception):
    """A user-facing error: the message names the file or key and the fix."""

    exit_code = 2


class ParamsError(AiaynError):
    """params.yaml has an unknown key, a wrong type or an impossible value."""


class DataError(AiaynError):
    """Input data is missing, malformed or inconsistent."""


class MissingPackageError(AiaynError):
    """An optional package (an extra such as ``aiayn[export]``) is not installed."""


class OutputError(AiaynError):
    """An output could not be written: the disk is full, the folder read-only, a quota or a
    file-size limit reached. Outputs written before are intact; the same command, run again
    once there is room, carries on (training resumes from its last checkpoint)."""
