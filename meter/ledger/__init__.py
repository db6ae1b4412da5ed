"""The credits ledger: a pure model, its storage half, and its methods."""
