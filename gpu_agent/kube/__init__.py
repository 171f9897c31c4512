"""Kubernetes sinks: GFD-compatible node labels, the GPUAgentReady condition, the NFD feature file."""
