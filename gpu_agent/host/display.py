"""Who holds nvidia_drm: a display (a process with one of the NVIDIA GPUs' DRM devices open: Xorg, a Wayland
compositor), which a driver reload never unloads from under, or the framebuffer console that nvidia-drm's fbdev
emulation carries (nvidia-drm.fbdev=1, which recent driver packages set), which a headless server has and
nobody looks at: the reload unbinds it from the framebuffer for the unload and binds it back after.

What tells them apart, under the root:
- /sys/class/drm/<card or renderD node>/device/driver names the driver of the GPU the node belongs to;
- /proc/PID/fd/* of a display server lead to /dev/dri/<node>;
- /sys/class/graphics/fb*/name is `nvidia-drmdrmfb` for nvidia-drm's framebuffer (DRM's fbdev helper names it
  after the driver), and /sys/class/vtconsole/vtcon*/ with name `(M) frame buffer device` and bind 1 is the
  framebuffer console bound to it;
- /proc/modules' refcount of nvidia_drm, less the modules that depend on it, counts the rest.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional, Protocol

from gpu_agent.errors import AgentError
from gpu_agent.host import processes
from gpu_agent.host.bounded import NotRegular, read_head
from gpu_agent.host.paths import Root
from gpu_agent.host.procfs import LoadedModule

DRM_CLASS = "/sys/class/drm"
GRAPHICS_CLASS = "/sys/class/graphics"
VTCONSOLE_CLASS = "/sys/class/vtconsole"
FRAMEBUFFER_CONSOLE = "frame buffer device"  # fbcon's vtconsole name, after its "(M) " or "(S) "
_NODE = re.compile(r"card[0-9]+|renderD[0-9]+")
_VTCON = re.compile(r"vtcon[0-9]+")


@dataclass(frozen=True)
class DrmUse:
    """What holds nvidia_drm now."""

    display: Optional[str]  # what the agent never takes away: a display server, or a holder it cannot name
    consoles: tuple[str, ...]  # vtconsoles bound to nvidia-drm's framebuffer


def drm_use(root: Root, module: Optional[LoadedModule]) -> DrmUse:
    """Who holds nvidia_drm (`module`, as /proc/modules lists it; None: not loaded)."""
    if module is None:
        return DrmUse(None, ())
    consoles = nvidia_consoles(root)
    nodes = nvidia_drm_nodes(root)
    if nodes:
        pattern = re.compile(r"(^|/)dev/dri/(" + "|".join(re.escape(node) for node in sorted(nodes)) + r")$")
        servers = processes.holding(root, pattern)
        if servers:
            return DrmUse(f"{', '.join(p.describe() for p in servers)} "
                          f"{'has' if len(servers) == 1 else 'have'} an NVIDIA DRM device open (a display)", consoles)
    users = (module.refcnt or 0) - len(module.holders)
    if users > 0 and not consoles:
        return DrmUse(f"nvidia_drm is held (refcount {module.refcnt}) by neither a process with an NVIDIA DRM device "
                      "open nor the framebuffer console", consoles)
    return DrmUse(None, consoles)


def nvidia_drm_nodes(root: Root) -> set[str]:
    """The DRM nodes (card*, renderD*) of GPUs the nvidia driver drives."""
    found = set()
    directory = root(DRM_CLASS)
    for entry in directory.iterdir() if directory.is_dir() else ():
        if not _NODE.fullmatch(entry.name):
            continue
        try:
            driver = os.path.basename(os.readlink(entry / "device" / "driver"))
        except OSError:
            continue
        if driver == "nvidia":
            found.add(entry.name)
    return found


def nvidia_consoles(root: Root) -> tuple[str, ...]:
    """The vtconsoles of the framebuffer console, bound, while nvidia-drm's framebuffer exists."""
    if not _nvidia_framebuffer(root):
        return ()
    directory = root(VTCONSOLE_CLASS)
    bound = []
    for entry in sorted(directory.iterdir()) if directory.is_dir() else ():
        if _VTCON.fullmatch(entry.name) and FRAMEBUFFER_CONSOLE in _text(entry / "name") \
                and _text(entry / "bind") == "1":
            bound.append(entry.name)
    return tuple(bound)


def _nvidia_framebuffer(root: Root) -> bool:
    directory = root(GRAPHICS_CLASS)
    return any(_text(entry / "name").startswith("nvidia-drm")
               for entry in (directory.iterdir() if directory.is_dir() else ()) if entry.name.startswith("fb"))


def _text(path: os.PathLike[str]) -> str:
    try:
        data = read_head(os.fspath(path), 256)
    except (NotRegular, OSError):
        return ""
    return "" if data is None else data.decode("utf-8", errors="replace").strip()


class ConsoleControl(Protocol):
    def bind(self, vtcon: str, bound: bool) -> None:
        """Bind the vtconsole to its framebuffer (or unbind it); AgentError when the kernel refuses."""


class SysfsConsole:
    """/sys/class/vtconsole/<vtcon>/bind of the running kernel: 0 unbinds the framebuffer console (the
    console falls back to the dummy one), 1 binds it again. Only for --root / ."""

    def __init__(self, root: Root) -> None:
        self.root = root

    def bind(self, vtcon: str, bound: bool) -> None:
        if not _VTCON.fullmatch(vtcon):
            raise AgentError(f"{vtcon!r} is no vtconsole (vtcon0, vtcon1, ...)")
        if not self.root.is_running_system:
            raise AgentError(f"refusing to {'bind' if bound else 'unbind'} the console {vtcon} of the running "
                             f"kernel while --root is {self.root.path}")
        path = self.root(f"{VTCONSOLE_CLASS}/{vtcon}/bind")
        try:  # a sysfs attribute: written in place, as the kernel takes it
            with open(path, "w", encoding="ascii") as handle:
                handle.write("1\n" if bound else "0\n")
        except OSError as exc:
            raise AgentError(f"cannot write {VTCONSOLE_CLASS}/{vtcon}/bind: {exc.strerror or exc}") from None
