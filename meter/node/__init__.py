"""A running node: its lifecycle, the wiring of its parts, its data dir and its loops.

:class:`Node` and :func:`build_storage` are its public face."""

from meter.node.lifecycle import Node
from meter.node.wiring import build_storage

__all__ = ["Node", "build_storage"]
