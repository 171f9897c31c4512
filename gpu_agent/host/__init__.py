"""Everything that touches the host: paths under --root, file writes, subprocesses."""
