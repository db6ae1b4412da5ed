"""A running node: its lifecycle, the wiring of its parts, its data dir and its loops."""
