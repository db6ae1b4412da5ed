"""The write-ahead log: every state-changing call is on disk before it is answered.

- :mod:`meter.wal.records`: the record framing (length, CRCs) and record types. Pure.
- :mod:`meter.wal.replay`: what a sequence of records leaves to recover. Pure.
- :mod:`meter.wal.log`: segments on disk, group commit, fsync policy, compaction.

May import :mod:`meter.errors`, :mod:`meter.core.keys` and :mod:`meter.core.counts` (the plain
fsync histogram); nothing here knows the table or the server (``tests/test_layers.py``
checks). See docs/durability.md and docs/adr/0003-write-ahead-log.md.
"""
