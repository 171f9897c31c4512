"""All GPU access: one narrow client over pynvml's surface."""
