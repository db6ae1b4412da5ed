"""When and how soon both clients try a call again, and how they read a node's answers.

The rules (docs/protocol.md, "Request ids and retries") are in the :mod:`meter.client`
docstring; the loops that apply them are each client's own (one blocks, one awaits), and
what they decide with is here.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable
from typing import Any

from meter.core.protocol import Response
from meter.errors import MeterError, Unavailable, from_wire

#: Default seconds, counted from the start of a call, during which a typed method keeps
#: retrying a call that got no answer or an ``unavailable`` one (0 disables retries).
DEFAULT_RETRY_TIMEOUT = 30.0
#: First pause between two attempts of a call; it doubles (with jitter) up to the maximum.
RETRY_BACKOFF_MIN = 0.05
RETRY_BACKOFF_MAX = 1.0


class Backoff:
    """The pauses between the attempts of one call, until ``retry_timeout`` after its start."""

    def __init__(self, start: float, budget: float) -> None:
        self.start = start
        self.deadline = start + budget
        self.attempts = 1
        self._delay = RETRY_BACKOFF_MIN

    def pause(self, err: Unavailable) -> float:
        """Seconds to wait before the next attempt; raises Unavailable once out of time."""
        now = time.monotonic()
        remaining = self.deadline - now
        if remaining <= 0:
            tries = f"{self.attempts} attempt{'s' if self.attempts != 1 else ''}"
            raise Unavailable(
                f"{err.message} (gave up after {tries} in {now - self.start:.1f}s)"
            ) from err
        delay = min(random.uniform(self._delay / 2, self._delay), remaining)
        self._delay = min(self._delay * 2, RETRY_BACKOFF_MAX)
        self.attempts += 1
        return delay


class Retrying:
    """What both clients decide a retry with."""

    #: Send a fresh random request id with every mutating call that has none.
    auto_ids: bool
    #: Seconds (from a call's start) a typed method keeps retrying; 0 disables retries.
    retry_timeout: float
    _path: str | None
    _closed: bool

    def _again(
        self, err: Unavailable, backoff: Backoff | None, start: float | None = None
    ) -> Backoff:
        """The backoff to pause with before trying again after ``err`` (a new one, counted
        from ``start`` or from now, if ``backoff`` is None); raises ``err`` if this client
        does not retry: ``retry_timeout`` 0, no socket path to reconnect to, or closed."""
        if self.retry_timeout <= 0 or self._path is None or self._closed:
            raise err
        if backoff is None:
            backoff = Backoff(time.monotonic() if start is None else start, self.retry_timeout)
        return backoff


def unavailable(error: Any) -> Unavailable:
    """An error answer as the Unavailable to try again after (the node did nothing); any
    other error is raised."""
    answered = from_wire(error)
    if not isinstance(answered, Unavailable):
        raise answered
    return answered


def result(resp: Response) -> Any:
    """A response's result, or its error raised."""
    if resp.error is not None:
        raise from_wire(resp.error)
    return resp.result


def results(responses: Iterable[Response], return_exceptions: bool) -> list[Any]:
    """A pipeline's results in call order; an error raises the first failing call's
    exception once all are read, or with ``return_exceptions`` stands in its place."""
    out: list[Any] = []
    first: MeterError | None = None
    for resp in responses:
        if resp.error is not None:
            err = from_wire(resp.error)
            first = first or err
            out.append(err)
        else:
            out.append(resp.result)
    if first is not None and not return_exceptions:
        raise first
    return out
