"""Opaque claim parameters of driver gpu.nvidia.com: `resource.nvidia.com/v1beta1` GpuConfig and MigDeviceConfig,
as NVIDIA's DRA driver reads them, read strictly (an unknown field, kind or value is the claim's error).

The facts are those of kubernetes-sigs/dra-driver-nvidia-gpu at 95932046683719c43b6a0dd9613c2e5aad5d6703
(api/nvidia.com/resource/v1beta1: gpuconfig.go, migconfig.go, sharing.go, validate.go; the order of
precedence in cmd/gpu-kubelet-plugin/device_state.go): a config comes from the device class or the claim,
the claim's after the class's and a later one after an earlier one, the last that applies to a device wins;
one naming requests applies to those requests' devices (and must fit their type), one naming none to every
device of its type. GpuConfig fits whole GPUs and MigDeviceConfig MIG devices. Sharing is `TimeSlicing`
(GpuConfig: `timeSlicingConfig.interval` Default, Short, Medium or Long) or `MPS` (`mpsConfig`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Mapping, Optional

from gpu_agent.dra.devices import DRIVER

API_VERSION = "resource.nvidia.com/v1beta1"
GPU_CONFIG, MIG_CONFIG = "GpuConfig", "MigDeviceConfig"
TIME_SLICING, MPS = "TimeSlicing", "MPS"
INTERVALS = ("Default", "Short", "Medium", "Long")
LEVELS = {name: level for level, name in enumerate(INTERVALS)}  # `nvidia-smi compute-policy --set-timeslice`'s
SOURCES = ("FromClass", "FromClaim")  # resource.k8s.io/v1 AllocationConfigSource, in order of precedence
_MPS_FIELDS = frozenset({"defaultActiveThreadPercentage", "defaultPinnedDeviceMemoryLimit",
                         "defaultPerDevicePinnedMemoryLimit", "multiUser"})
_MAX_CONFIGS = 64  # of one claim: the API allows 32 in the claim and 32 from classes (DeviceConfigMaxSize)


class ConfigError(ValueError):
    """A claim's opaque config that cannot be applied: the claim's answer, never a crash."""


@dataclass(frozen=True)
class MpsLimits:
    """A claim's mpsConfig, read: the default active thread percentage, the pinned memory limit of every
    device in MiB, and each device's own (by its UUID, or its index among the claim's devices of that
    config) overriding it."""

    threads: Optional[int] = None
    pinned_mib: Optional[int] = None
    per_device_mib: tuple[tuple[str, int], ...] = ()

    def pinned_for(self, uuids: tuple[str, ...]) -> Optional[tuple[int, ...]]:
        """Each of `uuids`' limit in MiB (0: none), as NVIDIA's driver resolves them; None when no limit is
        asked for. Raises ConfigError for a key that names no device of `uuids`."""
        if self.pinned_mib is None and not self.per_device_mib:
            return None
        limits = [self.pinned_mib or 0 for _ in uuids]
        for key, mib in self.per_device_mib:
            if key in uuids:
                limits[uuids.index(key)] = mib
            elif key.isascii() and key.isdigit() and int(key) < len(uuids):
                limits[int(key)] = mib
            else:
                raise ConfigError(f"sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit: {key[:64]!r} is neither the "
                                  f"UUID nor the index of a device of the claim ({len(uuids)} device(s))")
        return tuple(limits)


@dataclass(frozen=True)
class Sharing:
    strategy: str  # TIME_SLICING or MPS
    interval: str = ""  # TimeSlicing on a whole GPU: its timeSlicingConfig.interval ("Default" when not given)
    mps: Optional[MpsLimits] = None  # MPS: the limits its mpsConfig asks for (None: none given)


@dataclass(frozen=True)
class _Config:
    kind: str
    requests: tuple[str, ...]
    sharing: Optional[Sharing]
    where: str  # "config[2] (FromClaim)", for errors
    rank: int  # precedence: the class's before the claim's (the sort keeps the list's order within each)


def sharing_of(configs: Any, results: list[tuple[str, str, bool]]) -> dict[str, Optional[Sharing]]:
    """The sharing each allocated device gets: `configs` is the allocation's devices.config, `results` each
    (device, request, is a MIG device) of this driver. Raises ConfigError naming the config and what is wrong."""
    if configs is None:
        configs = []
    if not isinstance(configs, list):
        raise ConfigError("status.allocation.devices.config is not a list")
    if len(configs) > _MAX_CONFIGS:
        raise ConfigError(f"status.allocation.devices.config has {len(configs)} entries, more than {_MAX_CONFIGS}")
    ordered = [_read(number, entry) for number, entry in enumerate(configs)]
    ours = sorted((config for config in ordered if config is not None), key=lambda config: config.rank)
    found: dict[str, Optional[Sharing]] = {}
    for device, request, mig in results:
        wanted = MIG_CONFIG if mig else GPU_CONFIG
        found[device] = None
        for config in reversed(ours):
            if request in config.requests:
                if config.kind != wanted:
                    raise ConfigError(f"{config.where}: a {config.kind} cannot apply to {device!r} of request "
                                      f"{request!r}, a {'MIG device' if mig else 'whole GPU'} (it takes {wanted})")
                found[device] = config.sharing
                break
            if not config.requests and config.kind == wanted:
                found[device] = config.sharing
                break
    return found


def _read(number: int, entry: Any) -> Optional[_Config]:
    if not isinstance(entry, dict):
        raise ConfigError(f"config[{number}] is not an object")
    source = entry.get("source")
    if source not in SOURCES:
        raise ConfigError(f"config[{number}]: source {str(source)[:32]!r} is not one of {', '.join(SOURCES)}")
    where = f"config[{number}] ({source})"
    opaque = entry.get("opaque")
    if not isinstance(opaque, dict):
        raise ConfigError(f"{where}: only opaque parameters are read by {DRIVER}")
    if opaque.get("driver") != DRIVER:
        return None  # another driver's: a request may be met by either
    requests = entry.get("requests", [])
    if not isinstance(requests, list) or not all(isinstance(request, str) for request in requests):
        raise ConfigError(f"{where}: requests is not a list of names")
    parameters = opaque.get("parameters")
    if not isinstance(parameters, dict):
        raise ConfigError(f"{where}: opaque.parameters is not an object")
    kind = _kind(where, parameters)
    _only(where, parameters, {"apiVersion", "kind", "sharing"})
    sharing = parameters.get("sharing")
    return _Config(kind, tuple(requests), None if sharing is None else _sharing(where, kind, sharing), where,
                   SOURCES.index(source))


def _kind(where: str, parameters: Mapping[str, Any]) -> str:
    version, kind = parameters.get("apiVersion"), parameters.get("kind")
    if version != API_VERSION:
        raise ConfigError(f"{where}: apiVersion {str(version)[:64]!r} is not {API_VERSION}")
    if kind not in (GPU_CONFIG, MIG_CONFIG):
        raise ConfigError(f"{where}: kind {str(kind)[:64]!r} is not read by gpu-agent (it reads {GPU_CONFIG} and "
                          f"{MIG_CONFIG})")
    return str(kind)


def _sharing(where: str, kind: str, sharing: Any) -> Sharing:
    if not isinstance(sharing, dict):
        raise ConfigError(f"{where}: sharing is not an object")
    strategy = sharing.get("strategy")
    if strategy not in (TIME_SLICING, MPS):
        raise ConfigError(f"{where}: unknown sharing.strategy {str(strategy)[:32]!r} (it is {TIME_SLICING} or {MPS})")
    allowed = {"strategy", "mpsConfig"} | ({"timeSlicingConfig"} if kind == GPU_CONFIG else set())
    _only(where + " sharing", sharing, allowed)
    if strategy == MPS:
        if "timeSlicingConfig" in sharing:
            raise ConfigError(f"{where}: sharing.timeSlicingConfig cannot be used with the {MPS} strategy")
        return Sharing(MPS, mps=_mps(where, sharing.get("mpsConfig")))
    if "mpsConfig" in sharing:
        raise ConfigError(f"{where}: sharing.mpsConfig cannot be used with the {TIME_SLICING} strategy")
    if kind == MIG_CONFIG:
        return Sharing(TIME_SLICING)
    slicing = sharing.get("timeSlicingConfig") or {}
    if not isinstance(slicing, dict):
        raise ConfigError(f"{where}: sharing.timeSlicingConfig is not an object")
    _only(where + " sharing.timeSlicingConfig", slicing, {"interval"})
    interval = slicing.get("interval", "Default")
    if interval not in INTERVALS:
        raise ConfigError(f"{where}: unknown sharing.timeSlicingConfig.interval {str(interval)[:32]!r} (it is one "
                          f"of {', '.join(INTERVALS)})")
    return Sharing(TIME_SLICING, str(interval))


def _mps(where: str, config: Any) -> Optional[MpsLimits]:
    if config is None:
        return None
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: sharing.mpsConfig is not an object")
    _only(where + " sharing.mpsConfig", config, set(_MPS_FIELDS))
    threads = config.get("defaultActiveThreadPercentage")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or not 0 <= threads <= 100):
        raise ConfigError(f"{where}: sharing.mpsConfig.defaultActiveThreadPercentage {str(threads)[:32]!r} is not "
                          "a whole number from 0 to 100")
    if config.get("multiUser") not in (None, False):
        raise ConfigError(f"{where}: sharing.mpsConfig.multiUser: true is not supported by gpu-agent (its MPS "
                          "control daemons serve one user)")
    default = config.get("defaultPinnedDeviceMemoryLimit")
    pinned = None if default is None else _mebibytes(f"{where}: sharing.mpsConfig.defaultPinnedDeviceMemoryLimit",
                                                     default)
    per_device = config.get("defaultPerDevicePinnedMemoryLimit") or {}
    if not isinstance(per_device, dict):
        raise ConfigError(f"{where}: sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit is not a map")
    limits = tuple(sorted((str(key), _mebibytes(f"{where}: sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit"
                                                f"[{str(key)[:64]}]", value)) for key, value in per_device.items()))
    return MpsLimits(threads, pinned, limits)


# A Kubernetes quantity (k8s.io/apimachinery resource.Quantity): a decimal number, then a binary suffix, a
# decimal one or an exponent.
_QUANTITY = re.compile(r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?")
_SUFFIXES: dict[str, Fraction] = {
    **{suffix: Fraction(2) ** (10 * n) for n, suffix in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"), start=1)},
    **{suffix: Fraction(10) ** (3 * n) for n, suffix in enumerate(("k", "M", "G", "T", "P", "E"), start=1)},
    "m": Fraction(1, 1000)}


def _mebibytes(where: str, value: Any) -> int:
    """A memory limit in whole MiB, as NVIDIA's driver reads it (bytes / 1024 / 1024, at least 1)."""
    text = str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else None
    found = _QUANTITY.fullmatch(text.strip()) if text is not None and len(text) <= 64 else None
    if found is None:
        raise ConfigError(f"{where}: {str(value)[:64]!r} is not a quantity (such as 10Gi)")
    number, suffix = Fraction(found.group(1)), found.group(2) or ""
    scale = _SUFFIXES.get(suffix) or Fraction(10) ** int(suffix[1:] or 0)
    mib = int(number * scale) // 2 ** 20
    if mib <= 0:
        raise ConfigError(f"{where}: {text!r} is less than 1 MiB")
    return mib


def _only(where: str, found: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(found) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown field {str(unknown[0])[:64]!r} (read strictly, as NVIDIA's driver "
                          "does)")
