"""The /dev/char links as udev writes them: relative, one level up from /dev/char."""
from __future__ import annotations

import os

import pytest

from gpu_agent.host.devnodes import DeviceNode, link_target


@pytest.mark.parametrize("path", ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm-tools",
                                  "/dev/nvidia-caps/nvidia-cap1", "/dev/./nvidia3", "/dev/a/../nvidia4",
                                  "/dev//nvidia5", "/srv/nv0"])
def test_a_link_target_is_the_node_relative_to_dev_char(path: str) -> None:
    node = DeviceNode(path, 195, 0, 0o666)
    assert link_target(node) == os.path.relpath(path, "/dev/char")
    assert os.path.normpath(os.path.join("/dev/char", link_target(node))) == os.path.normpath(path)
