"""Build tests/data/captures/h100-580-vm/ from the files read on the real node in
h100-580-vm-raw/ beside it (see its README), in the format `gpu-agent capture` writes.

    .venv/bin/python tests/data/captures/build_h100_580_vm.py [NODE_FILES_DIR [OUT_DIR]]

Where each part comes from:
- files.json: proc-modules-and-sys-module.txt (/proc/modules, which /sys/module/nvidia* exist,
  /sys/module/nvidia/version), proc-devices.txt, proc-driver-nvidia-version.txt and -params.txt (verbatim),
  proc-driver-nvidia-capabilities.txt (one file per line, its fields one per line as the driver writes
  them), proc-driver-nvidia-gpus-information.txt (verbatim after its path line), sys-bus-pci-nvidia.txt
  (vendor, device, class, subsystem_*, numa_node), uname.txt (/etc/os-release's lines). The node has no
  /etc/modprobe.d; its DMI product name was not read.
- links.json: each PCI function's driver link (sys-bus-pci-nvidia.txt names the driver); the node has no
  /dev/char links.
- devices.json: dev-listing.txt (`ls -la /dev/nvidia* /dev/nvidia-caps`).
- ldcache.json: ldconfig-p.txt; every library leads to its versioned file in /usr/local/nvidia/lib64
  (as cdi-spec-as-generated.yaml shows).
- manifest.json: kernel release from uname.txt, no modprobe (binaries-on-path.txt), when from nvidia-smi-q.txt.
- nvml.json: nvml-readonly-dump.json (the second machine of the same kind), except the GPU's UUID, which is
  the first machine's (nvidia-smi-L.txt, as in its /proc/driver/nvidia/gpus/*/information), and the MIG
  placements, which the dump could not read: nvidia-smi-mig-lgipp.txt. The dump's field values (each
  with its own nvmlReturn) are one nvmlDeviceGetFieldValues call.
"""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import pynvml

from gpu_agent import __version__
from gpu_agent.host import ldcache
from gpu_agent.nvml import answers
from gpu_agent.capture import FORMAT, MANIFEST, PARTS, write_part

HERE = Path(__file__).resolve().parent
NODE_FILES = HERE / "h100-580-vm-raw"
OUT = HERE / "h100-580-vm"
LIBRARY_DIR = "/usr/local/nvidia/lib64"
GPU = answers.Handle("gpu0")
STRUCTS = {  # the dump's structures, by the pynvml class each call returns
    "nvmlDeviceGetPciInfo": "nvmlPciInfo_t", "nvmlDeviceGetPciInfo_v3": "nvmlPciInfo_t",
    "nvmlDeviceGetMemoryInfo": "c_nvmlMemory_t", "nvmlDeviceGetBAR1MemoryInfo": "c_nvmlBAR1Memory_t",
    "nvmlDeviceGetUtilizationRates": "c_nvmlUtilization_t",
}
LEFT_OUT = ("nvmlDeviceGetSerial", "nvmlDeviceIsMigDeviceHandle")  # another machine's serial; not an NVML answer
PREFIXED = {  # the dump's own keys: prefix -> (pynvml function, constant names after the prefix)
    "thr_": "nvmlDeviceGetTemperatureThreshold", "clock_": "nvmlDeviceGetClockInfo",
    "maxclock_": "nvmlDeviceGetMaxClockInfo", "retired_": "nvmlDeviceGetRetiredPages",
    "temp_": "nvmlDeviceGetTemperature",
}


def read(node: Path, name: str) -> str:
    return (node / name).read_text()


def files_part(node: Path) -> tuple[dict[str, str], list[str], dict[str, str]]:
    files: dict[str, str] = {}
    directories: list[str] = []
    links: dict[str, str] = {}
    lines = read(node, "proc-modules-and-sys-module.txt").splitlines()
    files["/proc/modules"] = "".join(line + "\n" for line in lines if len(line.split()) >= 5)
    words = [line for line in lines if len(line.split()) == 1]
    directories += [f"/sys/module/{name}" for name in words if not name[0].isdigit()]
    files["/sys/module/nvidia/version"] = next(w for w in words if w[0].isdigit()) + "\n"
    files["/proc/devices"] = read(node, "proc-devices.txt")
    files["/proc/driver/nvidia/version"] = read(node, "proc-driver-nvidia-version.txt")
    files["/proc/driver/nvidia/params"] = read(node, "proc-driver-nvidia-params.txt")
    for line in read(node, "proc-driver-nvidia-capabilities.txt").splitlines():
        path, _, fields = line.partition(": ")
        files[path] = "".join(f"{key}: {value}\n" for key, value in re.findall(r"(\w+): (\S+)", fields))
    information = read(node, "proc-driver-nvidia-gpus-information.txt").splitlines(keepends=True)
    files[information[0].strip()] = "".join(information[1:])
    for line in read(node, "sys-bus-pci-nvidia.txt").splitlines():
        path, *pairs = line.split()
        values = dict(pair.split("=", 1) for pair in pairs)
        subsystem_vendor, subsystem_device = values["subsys"].split(":")
        attributes = {"vendor": values["vendor"], "device": values["device"], "class": values["class"],
                      "subsystem_vendor": subsystem_vendor, "subsystem_device": subsystem_device,
                      "numa_node": values["numa"]}
        directories.append(path)
        files.update({f"{path}/{key}": f"{value}\n" for key, value in attributes.items()})
        links[f"{path}/driver"] = f"../../../bus/pci/drivers/{values['driver']}"
    os_release = [line for line in read(node, "uname.txt").splitlines() if "=" in line]
    files["/etc/os-release"] = "".join(line + "\n" for line in os_release)
    return files, directories, links


def devices_part(node: Path) -> list[dict[str, Any]]:
    devices: dict[str, dict[str, Any]] = {}
    directory = "/dev"
    for line in read(node, "dev-listing.txt").splitlines():
        if line.endswith(":"):
            directory = line[:-1]
            continue
        fields = line.split()
        if len(fields) < 9 or fields[0][0] not in "cd":
            continue
        name = fields[-1]
        owner = {"mode": f"{_mode(fields[0]):04o}", "uid": 0 if fields[2] == "root" else int(fields[2]),
                 "gid": 0 if fields[3] == "root" else int(fields[3])}
        if fields[0][0] == "d":
            if name == ".":
                devices[directory] = {"path": directory, "type": "directory", **owner}
            continue
        path = name if name.startswith("/") else f"{directory}/{name}"
        devices[path] = {"path": path, "type": "char", "major": int(fields[4].rstrip(",")),
                         "minor": int(fields[5]), **owner}
    return [devices[path] for path in sorted(devices)]


def _mode(permissions: str) -> int:
    bits = 0
    for position, char in enumerate(permissions[1:10]):
        if char != "-":
            bits |= 1 << (8 - position)
    return bits


def ldcache_part(node: Path, version: str) -> list[dict[str, Any]]:
    entries = []
    for line in read(node, "ldconfig-p.txt").splitlines():
        match = re.match(r"\s*(\S+) \(libc6,x86-64\) => (\S+)", line)
        if match:
            key, path = match.groups()
            stem = key.split(".so", 1)[0]
            entries.append({"key": key, "path": path, "flags": ldcache.FLAG_ELF_LIBC6 | ldcache.FLAG_X8664_LIB64,
                            "hwcap": 0, "target": f"{LIBRARY_DIR}/{stem}.so.{version}"})
    return entries


def nvml_part(node: Path) -> list[dict[str, Any]]:
    dump = json.loads(read(node, "nvml-readonly-dump.json"))
    device = dump["devices"][0]
    uuid = re.search(r"UUID: (GPU-[0-9a-f-]+)", read(node, "nvidia-smi-L.txt")).group(1)  # type: ignore[union-attr]
    calls: list[dict[str, Any]] = []

    def add(name: str, args: tuple[Any, ...], result: dict[str, Any], struct: str = "") -> None:
        key = json.loads(answers.call_key(name, args, {}, lambda value: None))
        if "error" in result:
            answer = {"error": result["error"].removeprefix("NVMLError_"), "code": result["code"]}
        else:
            value = result["ok"]
            answer = {"ok": {"struct": struct, "fields": value} if struct else value}
        calls.append({"call": key[0], "args": key[1], **answer})

    add("nvmlInit", (), {"ok": None})
    for name in ("nvmlSystemGetDriverVersion", "nvmlSystemGetNVMLVersion", "nvmlSystemGetCudaDriverVersion",
                 "nvmlSystemGetCudaDriverVersion_v2", "nvmlDeviceGetCount"):
        add(name, (), dump[name])
    add("nvmlDeviceGetHandleByIndex", (0,), {"ok": {"handle": "gpu0"}})
    add("nvmlDeviceGetUUID", (GPU,), {"ok": uuid})
    for name, result in device.items():
        if not name.startswith("nvmlDevice") or name in LEFT_OUT or name == "nvmlDeviceGetUUID" or "exc" in result:
            continue
        add(name, (GPU,), result, STRUCTS.get(name, ""))
    add("nvmlDeviceGetMemoryInfo", (GPU, pynvml.nvmlMemory_v2), device["memory_v2"], "c_nvmlMemory_v2_t")
    for key, result in device.items():
        prefix = next((p for p in PREFIXED if key.startswith(p)), None)
        if prefix:
            add(PREFIXED[prefix], (GPU, getattr(pynvml, key[len(prefix):])), result)
        elif key.startswith("ecc_"):
            error, counter = re.fullmatch(r"ecc_(NVML_MEMORY_ERROR_TYPE_\w+?)_(NVML_\w+_ECC)", key).groups()  # type: ignore[union-attr]
            add("nvmlDeviceGetTotalEccErrors", (GPU, getattr(pynvml, error), getattr(pynvml, counter)), result)
    add("nvmlDeviceGetFieldValues", (GPU, [(getattr(pynvml, name), 0) for name in device["field_values"]]),
        {"ok": [_field_value(getattr(pynvml, name), read) for name, read in device["field_values"].items()]})
    for profile in device["gi_profiles"].values():
        add("nvmlDeviceGetGpuInstanceProfileInfo", (GPU, profile["const"]), profile["info"],
            "c_nvmlGpuInstanceProfileInfo_v2_t")
    for line in read(node, "nvidia-smi-mig-lgipp.txt").splitlines():
        match = re.search(r"Profile ID\s+(\d+) Placements?\s*: \{([\d,]+)\}:(\d+)", line)
        if match:
            starts = [int(start) for start in match.group(2).split(",")]
            add(answers.PLACEMENTS_CALL, (GPU, int(match.group(1))),
                {"ok": [[start, int(match.group(3))] for start in starts]})
    return calls


def _field_value(field_id: int, read: dict[str, Any]) -> dict[str, Any]:
    """One of the dump's field values ({ret, type, value}) as a recorded c_nvmlFieldValue_t."""
    member = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")[read["type"]]
    return {"struct": "c_nvmlFieldValue_t", "fields": {
        "fieldId": field_id, "scopeId": 0, "timestamp": 0, "latencyUsec": 0, "valueType": read["type"],
        "nvmlReturn": read["ret"], "value": {"struct": "c_nvmlValue_t", "fields": {member: read["value"]}}}}


def manifest_part(node: Path, problems: list[str]) -> dict[str, Any]:
    stamp = re.search(r"Timestamp\s+: (.+)", read(node, "nvidia-smi-q.txt")).group(1).strip()  # type: ignore[union-attr]
    release = read(node, "uname.txt").split()[2]
    return {
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.strptime(stamp, "%a %b %d %H:%M:%S %Y")),
        "gpu_agent_version": __version__,
        "source": "../shared/hardware/h100-580-vm (NVIDIA H100 80GB HBM3 in a VM, driver 580.159.04), "
                  "built by tests/data/captures/build_h100_580_vm.py",
        "host": {"kernel_release": release, "modprobe": None},
        "parts": PARTS,
        "problems": problems,
    }


def build(node: Path, out: Path) -> None:
    files, directories, links = files_part(node)
    version = files["/sys/module/nvidia/version"].strip()
    out.mkdir(parents=True, exist_ok=True)
    write_part(out, "files.json", {"files": files, "directories": sorted(directories)})
    write_part(out, "links.json", links)
    write_part(out, "devices.json", devices_part(node))
    write_part(out, "ldcache.json", ldcache_part(node, version))
    write_part(out, "nvml.json", nvml_part(node))
    write_part(out, MANIFEST, manifest_part(node, [
        "/sys/class/dmi/id/product_name: not read on the node",
        "/sys/module/nvidia*/parameters: not read on the node",
    ]))


if __name__ == "__main__":
    build(Path(sys.argv[1]) if len(sys.argv) > 1 else NODE_FILES, Path(sys.argv[2]) if len(sys.argv) > 2 else OUT)
