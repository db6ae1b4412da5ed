"""How the node sets Python's cyclic garbage collector (ADR 0007).

Counting allocates little that lives: a gossip frame decodes to a few thousand short-lived
tuples, applied and dropped. With Python's default young threshold (700 allocations) a
loaded node collected every few hundred items, and the frame's live items, promoted, made
the full collections (which walk every warm row) run often: 9 % of a loaded node's CPU in
the profile, in pauses on the event loop. A larger young threshold lets a frame come and go
between collections; freezing what the node holds once it has recovered keeps its rows out
of every later collection. The node's rows hold no reference cycles: they are freed by
reference counting whatever the collector does. What is frozen is never collected: a cycle
among the startup objects that becomes garbage later stays (once, bounded by the startup
heap). Python 3.13+ changed the collector (3.14: incremental), so the threshold's meaning
there should be measured again before relying on it.
"""

from __future__ import annotations

import gc


def tune_gc(young_threshold: int) -> None:
    """Collect once, freeze what survives, and set the young threshold (0: leave Python's
    defaults alone, freeze nothing)."""
    if young_threshold <= 0:
        return
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(young_threshold, older, oldest)
