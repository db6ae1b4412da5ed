"""How ``meter serve`` writes its log: text for people, or one JSON object per line.

The JSON fields are stable (collectors parse them): ``ts`` (UTC, ISO 8601 with
milliseconds), ``level``, ``logger``, ``message`` (arguments already merged in), ``pid``, and
``exc`` (the formatted traceback) when a record carries one. A message holding client data
(a bad request's detail) is escaped by the encoder, so a record is always one line.
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
            "message": record.getMessage(),
            "pid": os.getpid(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def setup_logging(level: str, fmt: str) -> None:
    """Log records at ``level`` and above to stderr, as ``text`` or ``json``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
