"""meter: an in-memory usage-counter sidecar node."""

from meter import compiled as _compiled

__version__ = "0.1.0"
#: Which build this process runs: compiled by mypyc, or pure Python (``meter.compiled``).
BUILD = _compiled.choose()
