"""Errors a user can act on.  The CLI prints ``str(err)`` and exits with ``exit_code``."""

from __future__ import annotations


class SwiftLMError(Exception):
    exit_code = 2


class ModelNotFound(SwiftLMError):
    pass


class UnsupportedArchitecture(SwiftLMError):
    pass


class CorruptModel(SwiftLMError):
    pass


class BackendUnavailable(SwiftLMError):
    pass


class InvalidRequest(SwiftLMError, ValueError):
    """A request parameter is wrong; ``param`` names the field (OpenAI's error shape)."""

    status = 400  # HTTP status (subclasses: 413 for media over a size limit)

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class NotSupportedYet(SwiftLMError):
    pass


class ConfigError(SwiftLMError):
    """Settings that do not fit together (exit code 2)."""
