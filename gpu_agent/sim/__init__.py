"""A simulated GPU node: a fake of pynvml's surface backed by a machine state kept under --root."""
