#!/usr/bin/python3 -I
"""/usr/bin/gpu-agent: run the agent with the private dependencies built for this Python."""
import os
import sys

LIB = "/usr/lib/gpu-agent"
abi_dir = os.path.join(LIB, "site-cp{}{}".format(*sys.version_info[:2]))
if not os.path.isdir(abi_dir):
    built = sorted(d[len("site-cp"):] for d in os.listdir(LIB) if d.startswith("site-cp"))
    sys.stderr.write(
        "gpu-agent: no dependencies built for Python {}.{} in {} (built for: {}); "
        "install the gpu-agent package made for this distribution\n".format(
            sys.version_info[0], sys.version_info[1], LIB, ", ".join(v[0] + "." + v[1:] for v in built)
        )
    )
    sys.exit(1)
# The bytecode was compiled at install time (postinst); never written here, as /usr is read-only to
# the service and what dpkg or rpm does not know of stays what the package scripts put there.
sys.dont_write_bytecode = True
sys.path[:0] = [LIB, abi_dir, os.path.join(LIB, "site-common")]

from gpu_agent.cli import main  # noqa: E402

sys.exit(main())
