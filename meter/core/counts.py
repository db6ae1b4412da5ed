"""Plain counters and histogram buckets that the node's paths update, for :mod:`meter.ops.metrics`.

Pure (no I/O, no prometheus objects): the request path adds to ints and to a bucket list
indexed by :func:`bisect.bisect_left`, and the metrics collector turns them into Prometheus
families at scrape time. :class:`RequestStats` and :class:`FeatureUnits` are updated only while
metrics are on (``metrics_address``); the log's fsync and the flusher's round :class:`Buckets`
are kept always (one add per sync or round, off the request path), and so are the service's
refused ``track_many`` items by code (an error path).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable

from meter.core.keys import Key
from storage.base import MAX_MARK_UNITS

#: Request latency bucket bounds, seconds: a warm ``track`` answers in microseconds, one
#: waiting on the log's fsync in about a millisecond, one waiting on storage in tens of ms.
REQUEST_BOUNDS: tuple[float, ...] = (
    0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
#: fsync (``fdatasync``) latency bounds, seconds.
FSYNC_BOUNDS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip
#: Flush round duration bounds, seconds.
FLUSH_BOUNDS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip

#: The ``method`` label of requests naming no method the node has (bounded cardinality).
OTHER = "other"
#: Error results exported at 0 for every method from the start, so ``rate()`` and
#: ``increase()`` see their first one (alerts watch them); other codes appear when first seen.
PRESET_CODES: tuple[str, ...] = ("internal", "unavailable")


class Buckets:
    """A histogram as plain numbers: ``counts[i]`` observations ``<= bounds[i]`` (and above
    ``bounds[i-1]``), the last slot for those above every bound, and their sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def add(self, seconds: float, n: int = 1) -> None:
        """Record ``n`` observations of ``seconds``."""
        self.counts[bisect_left(self.bounds, seconds)] += n
        self.sum += seconds * n

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count)`` pairs as Prometheus wants them, ending with ``+Inf``."""
        out: list[tuple[str, int]] = []
        total = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            total += count
            out.append((repr(bound), total))
        out.append(("+Inf", total + self.counts[-1]))
        return out

    @property
    def count(self) -> int:
        """Every observation."""
        return sum(self.counts)


class RequestStats:
    """Requests answered, by method and result (``ok`` or the error code), and their latency
    by method: from the start of the read pass that brought the request to its answer being
    handed to the socket (after the log's commit when it waits for one).

    ``methods`` are the method names the node has; any other name is counted as ``other``, so
    a client cannot make labels up.
    """

    __slots__ = ("errors", "latency", "methods", "ok", "track_latency", "tracks")

    def __init__(self, methods: Iterable[str]) -> None:
        self.methods = frozenset(methods)
        self.ok: dict[str, int] = dict.fromkeys(self.methods, 0)
        #: ``track`` answered ``ok`` by the server's fast path (added to ``ok["track"]`` when
        #: read: one int add per pass on the hottest path).
        self.tracks = 0
        self.errors: dict[tuple[str, str], int] = {
            (m, code): 0 for m in sorted(self.methods) for code in PRESET_CODES
        }
        self.latency: dict[str, Buckets] = {m: Buckets(REQUEST_BOUNDS) for m in self.methods}
        #: ``latency["track"]``, which the server updates in place on its fast path.
        self.track_latency = self.latency.setdefault("track", Buckets(REQUEST_BOUNDS))

    def ok_counts(self) -> dict[str, int]:
        """Requests answered ``ok``, by method."""
        out = dict(self.ok)
        if self.tracks:
            out["track"] = out.get("track", 0) + self.tracks
        return out

    def batch(self, tracks: int, others: dict[str, int] | None, seconds: float) -> None:
        """A read pass's ok answers, each after ``seconds``: ``tracks`` fast-path tracks and
        ``others`` by method."""
        if tracks:
            self.tracks += tracks
            hist = self.track_latency
            hist.counts[bisect_left(hist.bounds, seconds)] += tracks
            hist.sum += seconds * tracks
        if others:
            self.answered(others, seconds)

    def label(self, method: object) -> str:
        """``method`` if the node has it, else ``other``."""
        return method if isinstance(method, str) and method in self.methods else OTHER

    def answered(self, counts: dict[str, int], seconds: float) -> None:
        """``counts[method]`` requests answered ``ok``, each after ``seconds``."""
        ok = self.ok
        latency = self.latency
        for method, n in counts.items():
            ok[method] = ok.get(method, 0) + n
            hist = latency.get(method)
            if hist is None:
                hist = latency[method] = Buckets(REQUEST_BOUNDS)
            hist.add(seconds, n)

    def tally(self, counts: dict[tuple[str, str | None], int], seconds: float) -> None:
        """``counts[(method, code)]`` requests answered (``code`` ``None``: ``ok``), each after
        ``seconds``; ``method`` labels already (:meth:`label`)."""
        for (method, code), n in counts.items():
            if code is None:
                self.ok[method] = self.ok.get(method, 0) + n
            else:
                key = (method, code)
                self.errors[key] = self.errors.get(key, 0) + n
            hist = self.latency.get(method)
            if hist is None:
                hist = self.latency[method] = Buckets(REQUEST_BOUNDS)
            hist.add(seconds, n)

    def failed(
        self,
        code: str,
        tracks: int,
        others: dict[str, int] | None,
        counts: dict[tuple[str, str | None], int] | None,
        seconds: float,
    ) -> None:
        """Answers that were to be what :meth:`batch` and :meth:`tally` take but were all
        answered ``code`` instead (the log's write failed: ``unavailable``)."""
        by_method: dict[tuple[str, str | None], int] = {}
        if tracks:
            by_method[("track", code)] = tracks
        for method, n in (others or {}).items():
            by_method[(method, code)] = by_method.get((method, code), 0) + n
        for (method, _), n in (counts or {}).items():
            by_method[(method, code)] = by_method.get((method, code), 0) + n
        self.tally(by_method, seconds)

    def one(self, method: str, code: str | None, seconds: float) -> None:
        """One request answered: ``code`` ``None`` for ``ok``, else its error code.
        ``method`` must be a label already (:meth:`label`)."""
        if code is None:
            self.ok[method] = self.ok.get(method, 0) + 1
        else:
            key = (method, code)
            self.errors[key] = self.errors.get(key, 0) + 1
        hist = self.latency.get(method)
        if hist is None:
            hist = self.latency[method] = Buckets(REQUEST_BOUNDS)
        hist.add(seconds)


class FeatureUnits:
    """Units stored, by feature, for at most ``cap`` features; later ones count as ``other``.

    Fed by the flusher with each key's net delta once storage holds it (off the request path).
    A counter cannot go down, so negative net deltas are summed apart (``removed``).
    """

    __slots__ = ("added", "cap", "removed")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.added: dict[str, int] = {}
        self.removed: dict[str, int] = {}

    def add(self, feature: str, delta: int) -> None:
        """Count a stored net ``delta`` of ``feature``."""
        if feature not in self.added and len(self.added) >= self.cap:
            feature = OTHER
        if feature not in self.added:
            self.added[feature] = 0
            self.removed[feature] = 0
        if delta >= 0:
            self.added[feature] += delta
        else:
            self.removed[feature] -= delta


class PeriodUnits:
    """The units this node took for storage, by period and feature, dimension counters left
    out (their units are their feature's): what its close of a period says it counted there
    (docs/invoicing.md). Every take is of units the node counted, and a period closes only
    once every take of it is stored. Kept by the write-ahead log (its ``FLUSH`` records, and
    ``UNITS`` in checkpoints); ``kept`` false (no log): :meth:`of` knows nothing, as a
    restart would start again from 0."""

    __slots__ = ("by_period", "inflight", "kept")

    def __init__(self, kept: bool = True) -> None:
        self.kept = kept
        self.by_period: dict[str, dict[str, int]] = {}
        #: The takes counted here that storage has not acknowledged: their sequence, by key
        #: (a checkpoint restates them: a retry of one, logged after it, is not a new take).
        self.inflight: dict[Key, int] = {}

    def take(self, key: Key, seq: int, units: int) -> None:
        """A take of ``key``'s ``units`` for storage under ``seq``: counted if new (a retry
        of the take in flight, under its sequence, is counted already)."""
        if self.inflight.get(key) != seq:
            self.add(key[2], key[1], units)
            self.inflight[key] = seq

    def stored(self, key: Key, seq: int) -> None:
        """Storage acknowledged ``key``'s take under ``seq``."""
        if self.inflight.get(key) == seq:
            del self.inflight[key]

    def add(self, period: str, feature: str, units: int) -> None:
        """Units of ``feature`` taken for storage in ``period``."""
        held = self.by_period.get(period)
        if held is None:
            held = self.by_period[period] = {}
        held[feature] = held.get(feature, 0) + units

    def of(self, period: str) -> dict[str, int] | None:
        """The units by feature of ``period`` (``None``: not known: no log, or more than
        :data:`~storage.base.MAX_MARK_UNITS` features, more than a mark holds)."""
        held = self.by_period.get(period, {})
        if not self.kept or len(held) > MAX_MARK_UNITS:
            return None
        return dict(held)

    def drop(self, period: str) -> None:
        """Forget ``period`` (closed: its mark holds them)."""
        self.by_period.pop(period, None)

    def restore(
        self,
        by_period: dict[str, dict[str, int]],
        inflight: dict[Key, int] | None = None,
    ) -> None:
        """The units the log holds, and the takes it holds in flight (a restart)."""
        self.by_period = {p: dict(held) for p, held in by_period.items()}
        self.inflight = dict(inflight or {})

    def items(self) -> list[tuple[str, str, int]]:
        """Every ``(period, feature, units)`` (a snapshot)."""
        return [(p, f, n) for p, held in self.by_period.items() for f, n in held.items()]
