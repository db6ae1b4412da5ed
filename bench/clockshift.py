"""``python -m bench.clockshift SECONDS serve``: ``meter serve`` with its wall clock moved.

For roll-over tests and the ``scale`` bench: a node whose clock reads a few seconds before
the end of a month meets a period roll-over under load without anyone waiting for the 1st.
Only ``time.time`` and ``time.time_ns`` move (periods, leases, expiries); the event loop's
monotonic clock does not. Every process of one cluster must be given the same shift.
"""

from __future__ import annotations

import sys
import time
from datetime import UTC, datetime


def shift_to(boundary: datetime, seconds_before: float) -> float:
    """The shift that puts the clock ``seconds_before`` ahead of ``boundary`` now."""
    return boundary.timestamp() - seconds_before - time.time()


def next_month_start(now: float | None = None) -> datetime:
    """The first instant of the UTC month after the one containing ``now``."""
    moment = datetime.fromtimestamp(time.time() if now is None else now, tz=UTC)
    year, month = (moment.year + 1, 1) if moment.month == 12 else (moment.year, moment.month + 1)
    return datetime(year, month, 1, tzinfo=UTC)


def install(shift: float) -> None:
    """Move this process's wall clock by ``shift`` seconds."""
    real, real_ns = time.time, time.time_ns
    time.time = lambda: real() + shift
    time.time_ns = lambda: real_ns() + int(shift * 1e9)


def main() -> int:
    if len(sys.argv) < 3:
        print("usage: python -m bench.clockshift SECONDS meter-args...", file=sys.stderr)
        return 2
    install(float(sys.argv[1]))
    sys.argv = ["meter", *sys.argv[2:]]
    from meter.cli.main import main as meter_main

    return meter_main()


if __name__ == "__main__":
    raise SystemExit(main())
