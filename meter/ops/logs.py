"""How ``meter serve`` writes its log: text for people, or one JSON object per line.

The JSON fields are stable (collectors parse them): ``ts`` (UTC, ISO 8601 with
milliseconds), ``level``, ``logger``, ``message`` (arguments already merged in), ``pid``, and
``exc`` (the formatted traceback) when a record carries one, ``stack`` when it carries a stack.
The encoder escapes everything outside ASCII and every control character, so a record is
always one line whatever a message holds. Python's warnings are logged too. What the CLI says
before logging is set up (a configuration error) stays a plain line on stderr.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        out: dict[str, object] = {
            "ts": ts.replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": _message(record),
            "pid": os.getpid(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        # ASCII: line separators such as U+2028 escaped too, so no reader splits a record.
        return json.dumps(out, ensure_ascii=True, default=str)


def _message(record: logging.LogRecord) -> str:
    try:
        return record.getMessage()
    except Exception:  # arguments that do not fit the format: keep both, never lose a record
        return f"{record.msg!s} {record.args!r}"


def setup_logging(level: str, fmt: str) -> None:
    """Log records at ``level`` and above to stderr, as ``text`` or ``json``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    logging.captureWarnings(True)
