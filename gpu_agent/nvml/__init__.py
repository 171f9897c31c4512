"""All GPU access: one narrow client over pynvml, or over the simulator's fake of the same surface."""
