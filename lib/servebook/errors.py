"""One exception class per failure mode, each with a message that says what to do."""

from __future__ import annotations


class ServebookError(Exception):
    """Base class; the CLI prints these without a traceback and exits non-zero."""

    exit_code = 1


class ParamsError(ServebookError):
    """A params file or override is invalid; nothing has started."""

    exit_code = 2

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source}: {len(problems)} problem(s), nothing was started:\n{lines}")


class NvmlUnavailable(ServebookError):
    """No NVIDIA driver or NVML library on this host."""


class PreflightError(ServebookError):
    """A check before launching failed; no process was started."""

    exit_code = 3


class LaunchError(ServebookError):
    """The server process died or never became healthy."""

    exit_code = 4

    def __init__(self, message: str, cause: str = "", log_tail: str = "", log_path: str = ""):
        self.cause = cause
        self.log_tail = log_tail
        self.log_path = log_path
        text = message
        if cause:
            text += f"\nroot cause: {cause}"
        if log_path:
            text += f"\nfull log: {log_path}"
        if log_tail:
            text += "\n--- last lines of the server log ---\n" + log_tail
        super().__init__(text)


class CleanupError(ServebookError):
    """Processes survived a stop, or foreign processes hold our resources."""

    exit_code = 5


class StageFailed(ServebookError):
    """A pipeline stage notebook raised; the run folder holds the partial report."""
