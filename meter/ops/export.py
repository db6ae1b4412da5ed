"""Usage export for invoicing: the ``export`` method's pages and the ``meter export`` writer.

Both read stored totals page by page through :meth:`storage.base.Storage.export_page`, so
memory is bounded by one page. What export reads, and when an export of a closed period is
complete: docs/operations.md, "Exporting usage for invoicing".
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import time
from collections.abc import Awaitable, Callable, Container, Iterator
from pathlib import Path
from typing import Any, Protocol, TextIO

from meter.core.dims import decode
from meter.core.keys import check_period
from meter.core.params import args as check_args
from meter.core.params import opts as check_opts
from meter.core.ports import Handler
from meter.errors import InvalidArgument, Unavailable
from meter.persist.closing import MarksAndOwners, close_state
from storage.base import (
    BadCursor,
    Counters,
    ExportPage,
    ExportRow,
    StorageError,
    UniqueValues,
    gauge_feature,
)

#: Most rows one ``export`` call answers: 1,000 rows of the longest names (512-byte tenants,
#: 256-byte features) stay inside the protocol's 1 MiB frame.
MAX_EXPORT_LIMIT = 1000
#: Rows per ``export`` call when the caller does not say.
DEFAULT_EXPORT_LIMIT = 1000
_OPTS = frozenset({"cursor", "limit"})
#: What MessagePack carries as an integer; a total outside goes as its decimal string.
_WIRE_MIN = -(2**63)
_WIRE_MAX = 2**64 - 1
#: The columns of a csv export, and the keys of a jsonl one. ``dims`` is empty for a
#: feature's total, else the dimension values of one of its dimension counters
#: (docs/dimensions.md): one value (every call that gave it), or two or more (calls that gave
#: exactly that combination). ``gauge`` is true for a gauge's row (``max``, ``latest``: its
#: value), false for a counter's (a gauge feature's counter holds calls counted by a node that
#: did not know it was a gauge).
COLUMNS = ("tenant", "feature", "period", "total", "dims", "gauge")


def parse_params(params: list[Any]) -> tuple[str, str | None, int]:
    """``[period, opts={cursor, limit}]`` as ``(period, cursor, limit)``; InvalidArgument."""
    period, opts = check_args("export", params, 1, 2)
    period = check_period(period)
    opts = check_opts("export", opts, _OPTS)
    cursor = opts.get("cursor")
    if cursor is not None and (not isinstance(cursor, str) or not cursor):
        raise InvalidArgument("export: cursor must be a string from a previous page, or nil")
    limit = opts.get("limit")
    if limit is None:
        limit = DEFAULT_EXPORT_LIMIT
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise InvalidArgument(f"export: limit must be an integer, got {type(limit).__name__}")
    if not 1 <= limit <= MAX_EXPORT_LIMIT:
        raise InvalidArgument(f"export: limit must be in 1..{MAX_EXPORT_LIMIT}, got {limit}")
    return period, cursor, limit


class ExportStore(Counters, MarksAndOwners, Protocol):
    """What the ``export`` method reads: counters, and the period's marks and owners."""


class ExportMethod:
    """The ``export`` method over one node's storage: a read of storage only, so units not
    flushed yet are not in it; each page says whether the period is final
    (docs/invoicing.md)."""

    def __init__(self, storage: ExportStore, grace_s: float) -> None:
        self.storage = storage
        self.grace_s = grace_s

    def handlers(self) -> dict[str, Handler]:
        return {"export": self.export}

    def export(self, params: list[Any]) -> Awaitable[dict[str, Any]]:
        period, cursor, limit = parse_params(params)
        return rpc_page(self.storage, period, cursor, limit, self.grace_s)


async def rpc_page(
    storage: ExportStore, period: str, cursor: str | None, limit: int, grace_s: float
) -> dict[str, Any]:
    """One page of the ``export`` method (its params checked by :func:`parse_params`):
    ``{"rows": [[tenant, feature, period, total], ...], "cursor": str | None, "final",
    "open_nodes", "closed_nodes", "closed_by_operator", "closes_at"}`` (:func:`close_state`,
    read before the page: a page of a period already final holds what stays); a dimension
    counter's row has a fifth element, its dimensions ``{name: value}``."""
    try:
        state = await close_state(storage, period, grace_s, time.time())
        page = await storage.export_page(period, cursor, limit)
    except BadCursor as exc:
        raise InvalidArgument(f"export: {exc}") from None
    except StorageError as exc:
        raise Unavailable(f"storage could not be read: {exc}") from None
    return {"rows": [_wire_row(r) for r in page.rows], "cursor": page.cursor, **state}


def _wire_row(row: ExportRow) -> list[Any]:
    total: int | str = row.total
    if not _WIRE_MIN <= row.total <= _WIRE_MAX:
        total = str(row.total)  # stored totals may outgrow 64 bits; MessagePack ints may not
    gauge = gauge_feature(row.feature)
    if gauge is not None:
        return [row.tenant, gauge, row.period, total, {}, "gauge"]
    feature, pairs, _ = decode(row.feature)
    if pairs:
        return [row.tenant, feature, row.period, total, dict(pairs)]
    return [row.tenant, feature, row.period, total]


def _columns(row: ExportRow) -> tuple[str, str, str, int, dict[str, str], bool]:
    """A row's columns, from storage (stored names) or from a node (``dims``, ``gauge``)."""
    gauge = gauge_feature(row.feature)
    if gauge is not None:
        return row.tenant, gauge, row.period, row.total, {}, True
    feature, pairs, _ = decode(row.feature)
    return row.tenant, feature, row.period, row.total, {**row.dims, **dict(pairs)}, row.gauge


# -- the ``meter export`` writer ----------------------------------------------------------------


class RowWriter:
    """Writes rows as csv (a header row first) or jsonl (one object per line) to a stream."""

    def __init__(self, stream: TextIO, fmt: str) -> None:
        if fmt not in ("csv", "jsonl"):
            raise InvalidArgument(f"format must be csv or jsonl, got {fmt!r}")
        self.stream = stream
        self.fmt = fmt
        self.rows = 0
        self._csv = csv.writer(stream, lineterminator="\n") if fmt == "csv" else None
        if self._csv is not None:
            self._csv.writerow(COLUMNS)

    def write(self, rows: list[ExportRow]) -> None:
        """Append ``rows``."""
        if self._csv is not None:
            self._csv.writerows(
                (*c[:4], json.dumps(c[4], sort_keys=True) if c[4] else "", "true" if c[5] else "")
                for c in map(_columns, rows)
            )
        else:
            self.stream.writelines(
                json.dumps(dict(zip(COLUMNS, _columns(r), strict=True))) + "\n" for r in rows
            )
        self.rows += len(rows)


async def export_to(
    storage: Counters,
    period: str,
    writer: RowWriter,
    progress: Callable[[int, ExportPage], None] | None = None,
) -> int:
    """Write every stored counter of ``period`` with ``writer``, page by page; return the rows
    written. ``progress(rows so far, page)`` is called after each page."""
    async for page in storage.export(period):
        writer.write(page.rows)
        if progress is not None:
            progress(writer.rows, page)
    return writer.rows


#: The columns of a ``meter export --values`` file: one row per value a unique feature counted.
VALUE_COLUMNS = ("tenant", "feature", "period", "value")
#: Values per storage read of ``--values``.
VALUES_PAGE = 1000


class ValueWriter:
    """Writes unique features' values as csv (a header row first) or jsonl to a stream."""

    def __init__(self, stream: TextIO, fmt: str) -> None:
        if fmt not in ("csv", "jsonl"):
            raise InvalidArgument(f"format must be csv or jsonl, got {fmt!r}")
        self.stream = stream
        self.rows = 0
        self._csv = csv.writer(stream, lineterminator="\n") if fmt == "csv" else None
        if self._csv is not None:
            self._csv.writerow(VALUE_COLUMNS)

    def write(self, key: tuple[str, str, str], values: list[str]) -> None:
        """Append ``key``'s ``values``."""
        if self._csv is not None:
            self._csv.writerows((*key, v) for v in values)
        else:
            self.stream.writelines(
                json.dumps(dict(zip(VALUE_COLUMNS, (*key, v), strict=True))) + "\n" for v in values
            )
        self.rows += len(values)


async def export_values_to(
    storage: Counters,
    values: UniqueValues,
    period: str,
    uniques: Container[str],
    writer: ValueWriter,
    progress: Callable[[int, ExportPage], None] | None = None,
) -> int:
    """Write every value the unique features (``uniques``) counted in ``period``, tenant by
    tenant (the stored counters tell which tenants have one), page by page; return the rows
    written. ``progress(rows so far, page)`` is called after each page of counters."""
    async for page in storage.export(period):
        for row in page.rows:
            if row.feature not in uniques:
                continue
            key = (row.tenant, row.feature, period)
            cursor: str | None = None
            while True:
                got, cursor = await values.values_page(key, cursor, VALUES_PAGE)
                writer.write(key, got)
                if cursor is None:
                    break
        if progress is not None:
            progress(writer.rows, page)
    return writer.rows


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[TextIO]:
    """A text stream whose content appears at ``path`` only once the block ends without an
    exception (a temp file beside it, fsynced, then renamed); on failure nothing is left."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as stream:
            yield stream
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    # The rename itself survives a power loss once the directory is synced.
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
