"""Benchmarks: side-by-side ratios against Redis and the write-per-event DynamoDB path.

Run with ``python -m bench`` (``--quick`` for about a minute, ``--only SCENARIO`` for one).
"""
