"""The test suite (a package so its harness, ``tests.support``, can be imported)."""
