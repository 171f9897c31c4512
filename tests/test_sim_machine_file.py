"""Machine files describe nodes of any size with PCI addresses a real machine could have (issue 15, item 10)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpu_agent.errors import AgentError
from gpu_agent.sim.machine import load_machine_file


def machine(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "machine.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("count", [1, 8, 16, 64])
def test_every_gpu_gets_a_distinct_valid_bus_id(tmp_path: Path, count: int) -> None:
    loaded, _ = load_machine_file(machine(tmp_path, f"gpus:\n  - model: H100-80GB-HBM3\n    count: {count}\n"))
    buses = [bus for _, bus in loaded.gpus]
    assert len(buses) == len(set(buses)) == count
    for bus in buses:
        domain, number, rest = bus.split(":")
        assert len(domain) == 8 and int(number, 16) <= 0xFF and rest == "00.0"


def test_default_bus_ids_stay_clear_of_nvswitches_and_nics(tmp_path: Path) -> None:
    loaded, _ = load_machine_file(machine(
        tmp_path, "gpus:\n  - model: H100-80GB-HBM3\n    count: 64\nnvswitches: 32\nmellanox_nics: 32\n"))
    gpus = {bus[-12:].lower() for _, bus in loaded.gpus}
    others = set(loaded.nvswitches) | set(loaded.mellanox_nics)
    assert len(others) == 64 and not gpus & others
    assert all(int(address.split(":")[1], 16) <= 0xFF for address in others)


def test_first_gpus_keep_their_addresses(tmp_path: Path) -> None:
    loaded, _ = load_machine_file(machine(tmp_path, "gpus:\n  - model: T4\n    count: 2\n"))
    assert [bus for _, bus in loaded.gpus] == ["00000000:10:00.0", "00000000:20:00.0"]


@pytest.mark.parametrize("bus, reason", [
    ("100:00.0", "not a PCI address"),  # bus above ff
    ("18:20.0", "not a PCI address"),  # device above 1f
    ("18:00.8", "not a PCI address"),  # function above 7
    ("eighteen", "not a PCI address"),
])
def test_invalid_bus_ids_are_refused_naming_the_key(tmp_path: Path, bus: str, reason: str) -> None:
    path = machine(tmp_path, f"gpus:\n  - model: T4\n    count: 1\n    pci_bus_ids: ['{bus}']\n")
    with pytest.raises(AgentError, match=rf"machine.yaml(:4)?: gpus\.0\.pci_bus_ids\.0: .*{reason}"):
        load_machine_file(path)


def test_a_bus_id_used_twice_is_refused(tmp_path: Path) -> None:
    path = machine(tmp_path, "gpus:\n  - model: T4\n    count: 2\n    pci_bus_ids: ['18:00.0', '0000:18:00.0']\n")
    with pytest.raises(AgentError, match=r"gpus\.0\.pci_bus_ids\.1: 0000:18:00.0 is already another GPU's"):
        load_machine_file(path)


def test_given_bus_ids_are_written_as_nvml_writes_them(tmp_path: Path) -> None:
    path = machine(tmp_path, "gpus:\n  - model: T4\n    count: 2\n    pci_bus_ids: ['1b:00.0', '0001:c4:1f.7']\n")
    loaded, _ = load_machine_file(path)
    assert [bus for _, bus in loaded.gpus] == ["00000000:1B:00.0", "00000001:C4:1F.7"]


@pytest.mark.parametrize("text, message", [
    (b"name: \xff\n", "machine.yaml:1: not UTF-8 text"),
    (b"gpus:\n  - model: T4\n    count: 300\n",
     "machine.yaml:3: gpus.0.count: Input should be less than or equal to 254"),
    (b"gpus:\n  - model: T4\n    count: 200\n  - model: A30\n    count: 60\n",
     "machine.yaml: gpus: 260 GPUs in all; at most 254"),
    (b"gpus:\n  - model: T4\n    count: 1\n    colour: red\n", "machine.yaml:4: gpus.0.colour: unknown key"),
    (b"gpus: &a [*a]\n", "machine.yaml:1:"),
    (b"- a list\n", "machine.yaml"),
])
def test_a_bad_machine_file_is_refused_naming_file_and_line(tmp_path: Path, text: bytes, message: str) -> None:
    path = tmp_path / "machine.yaml"
    path.write_bytes(text)
    with pytest.raises(AgentError) as caught:
        load_machine_file(path)
    assert message in str(caught.value)


@pytest.mark.parametrize("key, value, reason", [
    ("driver_version", "5/50", "expected a driver version such as 550.90.07"),
    ("driver_version", "../../../etc/x", "expected a driver version"),
    ("driver_version", "550.90.07/", "expected a driver version"),
    ("driver_version", "9" * 5000, "expected a driver version"),
    ("driver_version", "", "expected a driver version"),
    ("driver_version", "550", "expected a driver version"),
    ("driver_version", "550.90.07\n", "expected a driver version"),
    ("driver_version", "\u0665\u0665\u0660.90", "expected a driver version"),  # Arabic-Indic digits
    ("cuda_version", "1" + "2" * 5000 + ".4", "expected MAJOR.MINOR such as 12.4"),
    ("cuda_version", "\u00b2.4", "expected MAJOR.MINOR"),  # '²'.isdigit() is True, int('²') raises
    ("cuda_version", "12", "expected MAJOR.MINOR"),
    ("cuda_version", "12.4.1", "expected MAJOR.MINOR"),
    ("cuda_version", "100.0", "expected MAJOR.MINOR"),
    ("name", "n" * 65, "at most 64 characters"),
])
def test_versions_and_names_are_validated_naming_the_key_and_line(tmp_path: Path, key: str, value: str,
                                                                   reason: str) -> None:
    """A '/' in driver_version named files outside the library directory and then failed as a traceback;
    a cuda_version of 5,000 digits raised ValueError at int()."""
    path = tmp_path / "machine.yaml"
    path.write_text(yaml.safe_dump({key: value, "gpus": [{"model": "T4"}]}, sort_keys=False))
    with pytest.raises(AgentError) as caught:
        load_machine_file(path)
    assert str(caught.value).startswith(f"{path}:1: {key}: ") and reason in str(caught.value)


def test_a_valid_driver_and_cuda_version_are_taken() -> None:
    from gpu_agent.sim.machine_file import MachineSpec

    spec = MachineSpec.model_validate({"driver_version": "580.159.04", "cuda_version": "13.0"})
    assert (spec.driver_version, spec.cuda) == ("580.159.04", 13000)
    assert MachineSpec.model_validate({"driver_version": None}).driver_version is None
