"""The errors that mean bad input, and the ones that mean "stop". Each bad-input message is
one line naming the culprit, and the CLI maps every one of them to exit code 2. Nothing heavy
is imported here, so `hpo` reports a bad study file or option (and shows `--help`) without
first loading torch and transformers.
"""

import signal


class Terminated(KeyboardInterrupt):
    """SIGTERM (`docker stop`, Kubernetes evicting a pod): the worker stops as on Ctrl-C."""


class WorkerStopped(RuntimeError):
    """The worker gave up: too many trials in a row failed."""


class CheckError(ValueError):
    """`hpo check` found no model x precision of the study usable on this device."""


class ConfigError(ValueError):
    """Bad input in a study file or an override."""


class DataError(ValueError):
    """A problem with a data file, naming the file (and column/row if known).

    Line breaks that a bad value could smuggle in are folded into spaces here rather than
    trusted to every caller.
    """

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.splitlines()))


class FaultConfigError(ValueError):
    """A malformed fault-injection variable."""


class ModelError(ValueError):
    """A model or tokenizer that cannot be loaded."""


class SpaceError(ValueError):
    """The space cannot be searched on this device or disagrees with the study's pinned one."""


class StorageError(ValueError):
    """A storage that cannot be opened; the message carries no password."""


class StudyFormatError(ValueError):
    """A study written by a newer release of hpo in a format this one cannot read."""


BAD_INPUT = (CheckError, ConfigError, DataError, FaultConfigError, ModelError, SpaceError,
             StorageError, StudyFormatError)


def process_end(returncode: int | None) -> str:
    """How a child process ended, in words: "killed by SIGKILL", "exited with code 1"."""
    if returncode is None or returncode >= 0:
        return f"exited with code {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:  # a real-time signal has no name
        return f"killed by signal {-returncode}"


def one_line(exc: BaseException) -> str:
    """An error as one line of at most 500 characters, for a trial attribute or a log line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:500]
