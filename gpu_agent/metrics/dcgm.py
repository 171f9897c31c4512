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
XID_LABELS = ("err_code", "err_msg")  # dcgm-exporter's attributes of that series (internal/pkg/collector)
UNKNOWN_XID = "Unknown Error"


def xid_labels(xid: int) -> tuple[str, str]:
    """err_code and err_msg of a DCGM_FI_DEV_XID_ERRORS series whose value is `xid` (0: none yet), as
    dcgm-exporter's toMetric writes them: the number, and its text from the table below or Unknown Error."""
    return str(xid), XID_TEXT[xid] if 0 <= xid < len(XID_TEXT) else UNKNOWN_XID


# err_msg by XID: the label values dcgm-exporter gives each XID (its xidErrCodeToText, in
# internal/pkg/collector/xid_errors.go), character for character, so that alerts matching them keep
# matching; tests/test_metrics.py checks them against a digest of that map.
XID_TEXT = (
    "No Error",  # 0
    "Invalid or corrupted push buffer stream",  # 1
    "Invalid or corrupted push buffer stream",  # 2
    "Invalid or corrupted push buffer stream",  # 3
    "Invalid or corrupted push buffer stream",  # 4
    "Unused",  # 5
    "Invalid or corrupted push buffer stream",  # 6
    "Invalid or corrupted push buffer address",  # 7
    "GPU stopped processing",  # 8
    "Driver error programming GPU",  # 9
    "Unused",  # 10
    "Invalid or corrupted push buffer stream",  # 11
    "Driver error handling GPU exception",  # 12
    "Graphics Engine Exception",  # 13
    "Unused",  # 14
    "Unused",  # 15
    "Display engine hung",  # 16
    "Unused",  # 17
    "Bus mastering disabled in PCI Config Space",  # 18
    "Display Engine error",  # 19
    "Invalid or corrupted Mpeg push buffer",  # 20
    "Invalid or corrupted Motion Estimation push buffer",  # 21
    "Invalid or corrupted Video Processor push buffer",  # 22
    "Unused",  # 23
    "GPU semaphore timeout",  # 24
    "Invalid or illegal push buffer stream",  # 25
    "Framebuffer timeout",  # 26
    "Video processor exception",  # 27
    "Video processor exception",  # 28
    "Video processor exception",  # 29
    "GPU semaphore access error",  # 30
    "GPU memory page fault",  # 31
    "Invalid or corrupted push buffer stream",  # 32
    "Internal micro-controller error",  # 33
    "Video processor exception",  # 34
    "Video processor exception",  # 35
    "Video processor exception",  # 36
    "Driver firmware error",  # 37
    "Driver firmware error",  # 38
    "Unused",  # 39
    "Unused",  # 40
    "Unused",  # 41
    "Video processor exception",  # 42
    "GPU stopped processing",  # 43
    "Graphics Engine fault during context switch",  # 44
    "Preemptive cleanup, due to previous errors -- Most likely to see when running multiple cuda",  # 45
    "GPU stopped processing",  # 46
    "Video processor exception",  # 47
    "Double Bit ECC Error",  # 48
    "Unused",  # 49
    "Unused",  # 50
    "Unused",  # 51
    "Unused",  # 52
    "Unused",  # 53
    "Auxiliary power is not connected to the GPU board",  # 54
    "Unused",  # 55
    "Display Engine error",  # 56
    "Error programming video memory interface",  # 57
    "Unstable video memory interface detected",  # 58
    "Internal micro-controller error",  # 59
    "Video processor exception",  # 60
    "Internal micro-controller breakpoint/warning",  # 61
    "Internal micro-controller halt",  # 62
    "ECC page retirement or row remapping recording event",  # 63
    "ECC page retirement or row remapper recording failure",  # 64
    "Video processor exception",  # 65
    "Illegal access by driver",  # 66
    "Illegal access by driver",  # 67
    "NVDEC0 Exception",  # 68
    "Graphics Engine class error",  # 69
    "CE3: Unknown Error",  # 70
    "CE4: Unknown Error",  # 71
    "CE5: Unknown Error",  # 72
    "NVENC2 Error",  # 73
    "NVLINK Error",  # 74
    "CE6: Unknown Error",  # 75
    "CE7: Unknown Error",  # 76
    "CE8: Unknown Error",  # 77
    "vGPU Start Error",  # 78
    "GPU has fallen off the bus",  # 79
    "Corrupted data sent to GPU",  # 80
    "VGA Subsystem Error",  # 81
    "NVJPG0 Error",  # 82
    "NVDEC1 Error",  # 83
    "NVDEC2 Error",  # 84
    "CE9: Unknown Error",  # 85
    "OFA Exception",  # 86
    "Reserved",  # 87
    "NVDEC3 Error",  # 88
    "NVDEC4 Error",  # 89
    "Reserved",  # 90
    "Reserved",  # 91
    "High single-bit ECC error rate",  # 92
    "Non-fatal violation of provisioned InfoROM wear limit",  # 93
    "Contained ECC error",  # 94
    "Uncontained ECC error",  # 95
    "NVDEC5 Error",  # 96
    "NVDEC6 Error",  # 97
    "NVDEC7 Error",  # 98
    "NVJPG1 Error",  # 99
    "NVJPG2 Error",  # 100
    "NVJPG3 Error",  # 101
    "NVJPG4 Error",  # 102
    "NVJPG5 Error",  # 103
    "NVJPG6 Error",  # 104
    "NVJPG7 Error",  # 105
    "SMBPBI Test Message",  # 106
    "SMBPBI Test Message Silent",  # 107
    "Reserved",  # 108
    "Context Switch Timeout Error",  # 109
    "Security Fault Error",  # 110
    "Display Bundle Error Event",  # 111
    "Display Supervisor Error",  # 112
    "DP Link Training Error",  # 113
    "Display Pipeline Underflow Error",  # 114
    "Display Core Channel Error",  # 115
    "Display Window Channel Error",  # 116
    "Display Cursor Channel Error",  # 117
    "Display Pixel Pipeline Error",  # 118
    "GSP RPC Timeout",  # 119
    "GSP Error",  # 120
    "C2C Link Error",  # 121
    "SPI PMU RPC Read Failure",  # 122
    "SPI PMU RPC Write Failure",  # 123
    "SPI PMU RPC Erase Failure",  # 124
    "Inforom FS Failure",  # 125
    "Robust Channel CE10 Error",  # 126
    "Robust Channel CE11 Error",  # 127
    "Robust Channel CE12 Error",  # 128
    "Robust Channel CE13 Error",  # 129
    "Robust Channel CE14 Error",  # 130
    "Robust Channel CE15 Error",  # 131
    "Robust Channel CE16 Error",  # 132
    "Robust Channel CE17 Error",  # 133
    "Robust Channel CE18 Error",  # 134
    "Robust Channel CE19 Error",  # 135
    "ALI Training Fail",  # 136
    "NVLink Privilege Error",  # 137
    "Robust Channel DLA Error",  # 138
    "Robust Channel OFA1 Error",  # 139
    "Unrecovered ECC Error",  # 140
    "Robust Channel Fast Path Error",  # 141
    "Robust Channel NVENVC3 Error",  # 142
    "GPU Initialization Failure",  # 143
    "NVLINK: Saw Error",  # 144
    "NVLINK: RLW Error",  # 145
    "NVLINK: TLW Error",  # 146
    "NVLINK: TREX Error",  # 147
    "NVLINK: NVLPW_CTRL Error",  # 148
    "NVLINK: NETIR Error",  # 149
    "NVLINK: MSE Error",  # 150
    "Robust Channel Key rotation Error",  # 151
    "Robust Channel DLA SMMU Error",  # 152
    "Robust Channel DLA timeout Error",  # 153
    "GPU Recovery Action Changed",  # 154
    "NVLINK: SW Defined Error",  # 155
    "Resource Retirement Event",  # 156
    "Resource Retirement Failure",  # 157
    "GPU Fatal Timeout",  # 158
    "Robust Channel CHI Non-Data Error",  # 159
    "Channel Retirement Event",  # 160
    "Channel Retirement Failure",  # 161
    "Power Smoothing HW Circuitry Reengaged",  # 162
    "Power Smoothing HW Circuitry Disengaged",  # 163
    "Power Smoothing HW Circuitry Low Lifetime",  # 164
    "Power Smoothing HW Circuitry Lifetime Exhausted",  # 165
    "NVLINK Secure Crypto Error",  # 166
    "PCIE Fatal Timeout",  # 167
    "Reduced GPU Memory Capacity (Errors found in write protection region)",  # 168
    "Internal micro-controller halt",  # 169
    "NVLINK: Interrupt seen in CC mode",  # 170
    "Uncorrectable DRAM Error",  # 171
    "Uncorrectable SRAM Error",  # 172
)

# Every series carries these, in dcgm-exporter's order; GPU_I_PROFILE and GPU_I_ID come before Hostname
# on a GPU instance's series. DCGM_FI_DRIVER_VERSION is a "label" counter in the defaults file.
LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "DCGM_FI_DRIVER_VERSION")
MIG_LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "GPU_I_PROFILE", "GPU_I_ID", "Hostname",
              "DCGM_FI_DRIVER_VERSION")


def dcgm_bus_id(short: str) -> str:
    """0000:18:00.0 (the kernel's) as DCGM writes it: 00000000:18:00.0."""
    return f"0000{short}".upper() if short.count(":") == 2 and len(short.split(":")[0]) == 4 else short.upper()
