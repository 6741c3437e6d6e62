"""Every failure mode servebook raises, in one place, each with a message that says what to do.

The CLI prints a :class:`ServebookError` without a traceback and exits with its
``exit_code``; a notebook lets it surface, so papermill marks the failing cell.
"""

from __future__ import annotations


class ServebookError(Exception):
    """Base class; the CLI prints these without a traceback and exits non-zero."""

    exit_code = 1


class Interrupted(KeyboardInterrupt):
    """servebook was told to stop (SIGTERM, SIGHUP), handled as Ctrl-C is: what it started is stopped."""

    def __init__(self, how: str, exit_code: int):
        self.how, self.exit_code = how, exit_code
        super().__init__(how)


# ---------------------------------------------------------------- input


class ParamsError(ServebookError):
    """A params file or override is invalid; nothing has started."""

    exit_code = 2

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source}: {len(problems)} problem(s), nothing was started:\n{lines}")


class ModelConfigError(ServebookError):
    """A config.json is missing a field the planner needs."""

    def __init__(self, source: str, field_name: str, hint: str = ""):
        super().__init__(
            f"{source}: config.json has no '{field_name}'{'; ' + hint if hint else ''}; "
            "pass the checkpoint's complete config.json"
        )


class PlanInputError(ServebookError):
    """The hardware or context to plan for cannot be planned: an interconnect that is no link speed, GPUs that do
    not split over the nodes, an unknown GPU model, a context longer than the model allows."""

    exit_code = 2


class DatasetError(ServebookError):
    """A dataset file that cannot be benchmarked as it is."""

    exit_code = 2


class MissingRecord(ServebookError):
    """A stage needs an earlier stage's results file, which this run folder lacks, or a stage finished without
    writing its own."""


# ---------------------------------------------------------------- stage gates (go / no-go)


class NotReady(ServebookError):
    """Reconnaissance found reasons this host cannot serve the model yet."""

    def __init__(self, reasons: list[str]):
        super().__init__(
            "host not ready:\n  - "
            + "\n  - ".join(reasons)
            + "\nfix these, or set require_ready: false to go on anyway"
        )


class LayoutRejected(ServebookError):
    """The layout in the params would fail in vLLM; the plan says why before anything loads."""


class DownloadError(ServebookError):
    """The hub listing or a fetch failed."""


class HubUnreachable(DownloadError):
    """The Hugging Face Hub (or HF_ENDPOINT's mirror) does not answer, or HF_HUB_OFFLINE forbids asking it."""

    exit_code = 3


class InsufficientDisk(DownloadError):
    """Not enough free space for the download and its margin."""

    exit_code = 3


class VerificationFailed(DownloadError):
    """A downloaded file does not match its size, checksum or safetensors header."""


class SmokeTestFailed(ServebookError):
    """The server answered, but not correctly or not deterministically."""


class SweepAborted(ServebookError):
    """The server failed or stalled during the sweep; results so far are saved."""


class AbFailed(ServebookError):
    """A server A/B could not measure a variant (requests failed on a running server)."""


class DeployFailed(ServebookError):
    """The unit did not verify, or its pre/post-start commands failed against the real server."""


# ---------------------------------------------------------------- hardware and processes


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


class RemoteError(ServebookError):
    """A command that could not run on a node (unreachable, refused, timed out)."""

    exit_code = 4


class DiskFull(ServebookError):
    """A file servebook writes did not fit on its disk; the file before it is left as it was."""

    exit_code = 6

    def __init__(self, path: str, needed_bytes: int, free_bytes: int | None):
        self.path = path
        free = f"{free_bytes / 1e6:,.1f} MB free" if free_bytes is not None else "free space unknown"
        super().__init__(
            f"no space left for {path}: writing it needs about {needed_bytes / 1e6:,.1f} MB, {free} there; free "
            "space on that disk (or point SERVEBOOK_OUTPUTS or SERVEBOOK_CACHE at another) and run again"
        )


class CleanupError(ServebookError):
    """Processes survived a stop, or foreign processes hold our resources."""

    exit_code = 5


class RehearsalFailed(ServebookError):
    """No rehearsal candidate started and measured on dummy weights: each one's root cause is in the record."""
