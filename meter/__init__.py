"""meter: an in-memory usage-counter sidecar node."""

__version__ = "0.1.0"
