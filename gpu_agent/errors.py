"""Errors a user can act on, and the exit codes every command shares."""
from __future__ import annotations

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_NOT_READY = 2  # degraded or not ready


class AgentError(Exception):
    """A failure the user can fix; the message says what went wrong and what to do."""


class ConfigError(AgentError):
    """The configuration file cannot be used. The message names the file, the key and the reason."""


class StageError(AgentError):
    """A stage could not converge; the message is shown in /status and /readyz?verbose."""


class TransientError(StageError):
    """A stage's failure that passes by itself (the Kubernetes API server restarting or shedding load): its
    next run is due at `retry_at` (unix time), on the schedule of what failed rather than the stage's own
    backoff, which is for faults on the host. Logged where it happened, not again by the engine."""

    def __init__(self, message: str, retry_at: float) -> None:
        super().__init__(message)
        self.retry_at = retry_at


class HostFormatError(StageError):
    """A kernel or driver file says something the agent cannot read: names the file, the line, what was expected."""

    def __init__(self, path: str, line_number: int, line: str, expected: str) -> None:
        shown = line if len(line) <= 120 else line[:117] + "..."
        super().__init__(f"{path}:{line_number}: cannot read {shown!r}: expected {expected}")
        self.path = path
        self.line_number = line_number
