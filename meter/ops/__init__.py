"""Operating a node: metrics, the HTTP probes, logs and usage export."""
