"""The features the fleet counts: their declarations (aggregation, dimensions, the bound on
dimension counters), set once and kept with the limits (docs/dimensions.md)."""
