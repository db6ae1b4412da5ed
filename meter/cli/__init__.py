"""The ``meter`` command: :func:`main`."""

from meter.cli.main import main

__all__ = ["main"]
