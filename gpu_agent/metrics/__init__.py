"""GPU metrics: the background sampler and the dcgm-exporter-compatible /metrics exporter."""
