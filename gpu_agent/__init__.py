"""gpu-agent: make a node's NVIDIA GPUs ready for Kubernetes and containers, and keep them that way."""

__version__ = "0.1.0"
