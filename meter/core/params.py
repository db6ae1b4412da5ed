"""The one parameter checker of the wire methods: arity, option maps, reservation ids.

Every method, in :mod:`meter.core` and in the features, checks its params here, so an error of
one kind reads the same on the wire whichever method raised it. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meter.errors import InvalidArgument

#: Longest reservation id (the node's own are 32 hex digits).
MAX_RESERVATION_ID = 64


def args(
    method: str, params: list[Any], least: int, most: int, defaults: tuple[Any, ...] = ()
) -> list[Any]:
    """``params`` of ``method`` with ``least`` to ``most`` entries, the missing trailing ones
    filled from ``defaults`` (the values of the optional ones, in order), else ``None``."""
    n = len(params)
    if not least <= n <= most:
        want = str(least) if least == most else f"{least} to {most}"
        raise InvalidArgument(f"{method} takes {want} params, got {n}")
    if n == most:
        return params
    if defaults:
        return [*params, *defaults[n - least :]]
    return [*params, *([None] * (most - n))]


def opts(
    method: str, value: Any, allowed: frozenset[str], *, nil_is_absent: bool = False
) -> Mapping[str, Any]:
    """The options map of a call of ``method`` (``nil``: none), every name in ``allowed``;
    with ``nil_is_absent`` an option given as ``nil`` is left out, as if not given."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidArgument(f"{method}: opts must be a map, got {type(value).__name__}")
    for name in value:
        if name not in allowed:
            names = ", ".join(sorted(allowed))
            raise InvalidArgument(f"{method}: unknown option {str(name)[:32]!r} (allowed: {names})")
    if nil_is_absent:
        return {k: v for k, v in value.items() if v is not None}
    return value


def reservation_id(rid: Any) -> str:
    """A reservation id from the wire: a non-empty UTF-8 string of at most 64 chars."""
    if isinstance(rid, bytes):
        try:
            rid = rid.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidArgument("reservation id is not valid UTF-8") from None
    if not isinstance(rid, str) or not rid or len(rid) > MAX_RESERVATION_ID:
        raise InvalidArgument("reservation id must be a non-empty string of at most 64 chars")
    try:
        rid.encode("utf-8")
    except UnicodeEncodeError:  # invalid UTF-8 from the wire, decoded with surrogateescape
        raise InvalidArgument("reservation id is not valid UTF-8") from None
    return rid
