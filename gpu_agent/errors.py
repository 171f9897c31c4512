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
