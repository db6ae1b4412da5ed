"""The test suite (a package so helpers like ``tests.dynamodb_local`` can be imported)."""
