"""Counter keys, periods and the validation of the names in them.

A key is ``(tenant, feature, period)``. ``period`` is the period's name
(:mod:`storage.periods`, docs/periods.md): ``"2026-11"`` for a UTC calendar month (the
default), ``"2026-11-30"`` for a UTC day, ``"2026-11@15:America/New_York"`` for a billing
cycle's month and ``"2026-11-30@America/New_York"`` for a zone's day. Storage lists "every
counter of a tenant in a period" with one query on ``<period>#``. A new period is a new key:
roll-over needs no reset.
"""

from __future__ import annotations

import math
import re
import time
from datetime import UTC, datetime
from typing import Final, Literal

from meter.errors import InvalidArgument
from storage.base import StoragePermanentError
from storage.base import check_period as _storage_check_period

Key = tuple[str, ...]
PeriodKind = Literal["month", "day"]

#: Longest tenant name, in UTF-8 bytes. Sized so a DynamoDB partition key (tenant) stays far
#: inside its 2048-byte limit and a sort key (period + "#" + feature) inside 1024 bytes.
MAX_TENANT_BYTES = 512
#: Longest feature name, in UTF-8 bytes.
MAX_FEATURE_BYTES = 256
#: Tenants: letters, digits and ``_ - . : @ /`` (``/`` separates account/user levels).
TENANT_RE = re.compile(r"[A-Za-z0-9_\-.:@/]+")
#: Features: letters, digits and ``_ - . :``.
FEATURE_RE = re.compile(r"[A-Za-z0-9_\-.:]+")
#: A quantity is a signed 64-bit integer.
QTY_MIN = -(2**63)
QTY_MAX = 2**63 - 1
#: Hot paths test a number against these first and against QTY_MIN and QTY_MAX only past
#: them (:func:`in_range`): compiled, an int inside them is a machine word (mypyc's short
#: ints are 63-bit) and its compare one instruction, while a compare with a 64-bit bound
#: makes an int object of it each time.
SHORT_MIN: Final = -4611686018427387904
SHORT_MAX: Final = 4611686018427387903
#: Instants accepted in ``opts.at`` (epoch seconds): 1970 .. 9999.
AT_MIN = 0
AT_MAX = 253402300799


def check_tenant(tenant: object) -> str:
    """Return ``tenant`` if it is a valid tenant name, else raise :class:`InvalidArgument`."""
    return _check_name("tenant", tenant, MAX_TENANT_BYTES, TENANT_RE)


def check_feature(feature: object) -> str:
    """Return ``feature`` if it is a valid feature name, else raise :class:`InvalidArgument`."""
    return _check_name("feature", feature, MAX_FEATURE_BYTES, FEATURE_RE)


def _check_name(what: str, name: object, max_bytes: int, pattern: re.Pattern[str]) -> str:
    if isinstance(name, bytes | bytearray):
        try:
            name = bytes(name).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidArgument(f"{what} is not valid UTF-8") from None
    if not isinstance(name, str):
        raise InvalidArgument(f"{what} must be a string, got {type(name).__name__}")
    if not name:
        raise InvalidArgument(f"{what} must not be empty")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:  # invalid UTF-8 from the wire, decoded with surrogateescape
        raise InvalidArgument(f"{what} is not valid UTF-8") from None
    if size > max_bytes:
        raise InvalidArgument(f"{what} is longer than {max_bytes} bytes")
    if pattern.fullmatch(name) is None:
        raise InvalidArgument(f"{what} {name[:64]!r} has characters outside {pattern.pattern}")
    return name


def in_range(qty: int) -> bool:
    """Whether ``qty`` is in the signed 64-bit range."""
    return SHORT_MIN <= qty <= SHORT_MAX or QTY_MIN <= qty <= QTY_MAX


def check_qty(qty: object, *, what: str = "qty", allow_negative: bool = True) -> int:
    """Return ``qty`` if it is an int in the signed 64-bit range, else raise."""
    if isinstance(qty, bool) or not isinstance(qty, int):
        raise InvalidArgument(f"{what} must be an integer, got {type(qty).__name__}")
    if not QTY_MIN <= qty <= QTY_MAX:
        raise InvalidArgument(f"{what} {qty} is outside the signed 64-bit range")
    if not allow_negative and qty < 0:
        raise InvalidArgument(f"{what} must not be negative, got {qty}")
    return qty


def check_at(at: object) -> float:
    """Return an ``opts.at`` instant (epoch seconds, int or float) if valid, else raise."""
    if isinstance(at, bool) or not isinstance(at, int | float):
        raise InvalidArgument(f"at must be epoch seconds (int or float), got {type(at).__name__}")
    if not AT_MIN <= at <= AT_MAX or at != at:  # NaN fails the range check only sometimes
        raise InvalidArgument(f"at {at!r} is outside {AT_MIN}..{AT_MAX}")
    return float(at)


def period_start(kind: PeriodKind, at: float | None = None) -> str:
    """The period of ``kind`` containing the instant ``at`` (epoch seconds, default now),
    judged on the whole second (as :func:`storage.periods.name`: a time is rounded to
    microseconds, which would move an instant a hair before midnight into the next day)."""
    moment = datetime.fromtimestamp(math.floor(time.time() if at is None else at), tz=UTC)
    if kind == "month":
        return f"{moment.year:04d}-{moment.month:02d}"
    return f"{moment.year:04d}-{moment.month:02d}-{moment.day:02d}"


def check_period(period: object) -> str:
    """Return ``period`` if it names a period counters are kept under (a UTC month or day, a
    billing cycle's month or a zone's day: :mod:`storage.periods`), else raise
    :class:`InvalidArgument`."""
    if isinstance(period, bytes | bytearray):
        try:
            period = bytes(period).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidArgument("period is not valid UTF-8") from None
    try:
        return _storage_check_period(period)
    except StoragePermanentError as exc:
        raise InvalidArgument(str(exc)) from None
