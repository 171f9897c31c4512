#!/usr/bin/python3 -I
"""/usr/bin/gpu-agent: run the agent with the private dependencies built for this Python."""
import os
import sys

LIB = "/usr/lib/gpu-agent"
running = f"{sys.version_info[0]}.{sys.version_info[1]}"
site = os.path.join(LIB, "site-cp" + running.replace(".", ""))
if not os.path.isdir(site):
    # The package carries one site-cpXY: the compiled dependencies of the python3 it was built for.
    built = sorted(d[len("site-cp"):] for d in (os.listdir(LIB) if os.path.isdir(LIB) else [])
                   if d.startswith("site-cp"))
    wanted = " or ".join(f"Python {v[0]}.{v[1:]}" for v in built) or f"another Python (no site-cp* in {LIB})"
    sys.stderr.write(
        f"gpu-agent: this package was built for {wanted}, but {sys.executable or 'python3'} is Python {running}; "
        "its compiled dependencies load into that Python only. Install the gpu-agent package built for this "
        "distribution's python3.\n"
    )
    sys.exit(1)
# The bytecode was compiled at install time (postinst); never written here, as /usr is read-only to
# the service and what dpkg or rpm does not know of stays what the package scripts put there.
sys.dont_write_bytecode = True
sys.path[:0] = [LIB, site]

from gpu_agent.cli import main  # noqa: E402

sys.exit(main())
