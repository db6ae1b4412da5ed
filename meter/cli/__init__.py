"""The ``meter`` command."""
