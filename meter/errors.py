"""The project's exception hierarchy; each class carries its wire error code.

Third-party errors (botocore, redis, sqlite3) are mapped to these at the boundary, so callers
and the socket protocol only ever see one of the codes below.
"""

from __future__ import annotations


class MeterError(Exception):
    """Base of every error the node reports; ``code`` is the wire error code."""

    code = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_wire(self) -> dict[str, str]:
        """The structured error sent in a response: ``{"code": ..., "message": ...}``."""
        return {"code": self.code, "message": self.message}


class InvalidArgument(MeterError):
    """A parameter is missing, of the wrong type, or out of range."""

    code = "invalid_argument"


class UnknownMethod(MeterError):
    """The request named a method the node does not have."""

    code = "unknown_method"


class LimitExceeded(MeterError):
    """A reservation would take a counter past its limit; nothing was reserved."""

    code = "limit_exceeded"


class InsufficientBalance(MeterError):
    """A ledger debit would take the balance below zero; nothing changed (docs/ledger.md)."""

    code = "insufficient_balance"


class NotFound(MeterError):
    """The reservation id is unknown (never issued, already finished, or expired)."""

    code = "not_found"


class Conflict(MeterError):
    """A request id was reused with another method or payload; nothing was counted."""

    code = "conflict"


class PeriodClosed(MeterError):
    """A call would count in a period that ended ``period_grace_s`` or more ago; nothing
    was counted (docs/protocol.md)."""

    code = "period_closed"


class Unavailable(MeterError):
    """The node cannot answer truthfully now (storage unreachable, draining); retry later."""

    code = "unavailable"


class Internal(MeterError):
    """A bug or an unexpected failure inside the node."""

    code = "internal"


class ConfigError(MeterError):
    """A configuration setting is invalid; ``setting`` names it."""

    code = "invalid_argument"

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(f"{setting}: {message}")
        self.setting = setting


#: Wire code -> exception class, for clients turning error maps back into exceptions.
BY_CODE: dict[str, type[MeterError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        UnknownMethod,
        LimitExceeded,
        InsufficientBalance,
        NotFound,
        Conflict,
        PeriodClosed,
        Unavailable,
        Internal,
    )
}


def from_wire(error: object) -> MeterError:
    """Turn an error value from a response into the matching exception."""
    if isinstance(error, dict):
        code = error.get("code")
        message = error.get("message")
        cls = BY_CODE.get(code if isinstance(code, str) else "", MeterError)
        err = cls(str(message) if message is not None else str(error))
        if cls is MeterError:
            err.code = str(code)
        return err
    return MeterError(str(error))
