"""GPU health: XID events, and the checks that decide whether a GPU is healthy."""
