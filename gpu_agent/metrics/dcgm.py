"""dcgm-exporter's default counters (etc/default-counters.csv of its 4.5.3-4.8.2 release) that NVML can
supply, with the GpuSample field each comes from. Same name, type and help text, so that dashboards and
alerts written for dcgm-exporter keep working."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Counter:
    name: str
    kind: str  # "gauge" or "counter", as dcgm-exporter declares it
    help: str
    field: str  # of GpuSample
    per_gpu_instance: bool = False  # also reported per GPU instance on a MIG GPU (framebuffer, GPM)


DEFAULT_COUNTERS = (
    Counter("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).", "sm_clock_mhz"),
    Counter("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz).", "memory_clock_mhz"),
    Counter("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C).", "memory_temperature_c"),
    Counter("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", "temperature_c"),
    Counter("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", "power_w"),
    Counter("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter", "Total energy consumption since boot (in mJ).",
            "energy_mj"),
    Counter("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries.", "pcie_replays"),
    Counter("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", "utilization_percent"),
    Counter("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %).", "memory_copy_utilization_percent"),
    Counter("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %).", "encoder_utilization_percent"),
    Counter("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %).", "decoder_utilization_percent"),
    Counter("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).", "memory_free_mib", True),
    Counter("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).", "memory_used_mib", True),
    Counter("DCGM_FI_DEV_FB_RESERVED", "gauge", "Framebuffer memory reserved (in MiB).", "memory_reserved_mib", True),
    Counter("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter", "Number of remapped rows for uncorrectable errors",
            "uncorrectable_remapped_rows"),
    Counter("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter", "Number of remapped rows for correctable errors",
            "correctable_remapped_rows"),
    Counter("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed", "row_remap_failure"),
    # Where the GPU has NVLink; the first sample has no value, a rate needs two.
    Counter("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "counter",
            "Total number of NVLink bandwidth counters for all lanes.", "nvlink_bandwidth_total"),
    # From NVML GPM where the GPU has it (Hopper and later), over the interval between two samples.
    Counter("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", "Ratio of time the graphics engine is active.",
            "gr_engine_active", True),
    Counter("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge", "Ratio of cycles the tensor (HMMA) pipe is active.",
            "pipe_tensor_active", True),
    Counter("DCGM_FI_PROF_DRAM_ACTIVE", "gauge",
            "Ratio of cycles the device memory interface is active sending or receiving data.", "dram_active", True),
    Counter("DCGM_FI_PROF_PCIE_TX_BYTES", "gauge", "The rate of data transmitted over the PCIe bus - including both "
            "protocol headers and data payloads - in bytes per second.", "pcie_tx_bytes", True),
    Counter("DCGM_FI_PROF_PCIE_RX_BYTES", "gauge", "The rate of data received over the PCIe bus - including both "
            "protocol headers and data payloads - in bytes per second.", "pcie_rx_bytes", True),
)

XID_ERRORS = Counter("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.", "")

# Every series carries these, in dcgm-exporter's order; GPU_I_PROFILE and GPU_I_ID come before Hostname
# on a GPU instance's series. DCGM_FI_DRIVER_VERSION is a "label" counter in the defaults file.
LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "DCGM_FI_DRIVER_VERSION")
MIG_LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "GPU_I_PROFILE", "GPU_I_ID", "Hostname",
              "DCGM_FI_DRIVER_VERSION")


def dcgm_bus_id(short: str) -> str:
    """0000:18:00.0 (the kernel's) as DCGM writes it: 00000000:18:00.0."""
    return f"0000{short}".upper() if short.count(":") == 2 and len(short.split(":")[0]) == 4 else short.upper()
