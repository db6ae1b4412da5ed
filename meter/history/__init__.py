"""History: a counter's units per UTC day or month over a range."""
