"""dcgm-exporter 4.5.3-4.8.2's test cases for what the agent took over, as our own data
(github.com/NVIDIA/dcgm-exporter, tag 4.5.3-4.8.2, commit below). Each table names the file and test it
re-expresses; tests/test_metrics_dcgm48.py replays them on the agent.
"""
from __future__ import annotations

COMMIT = "691c92762eb551313c825f6efe4ceeee20982801"  # tag 4.5.3-4.8.2

# internal/pkg/transformation/kubernetes_label_filter_test.go, TestShouldIncludeLabel:
# (allowlist, label key, whether the label is kept).
LABEL_FILTER = (
    ((), "any-label", True),
    ((), "app.kubernetes.io/name", True),
    (("^app$",), "app", True),
    (("^app$",), "tier", False),
    ((r"^app\..*",), "app.kubernetes.io/name", True),
    ((r"^app\..*",), "tier", False),
    (("^app$", "^tier$"), "app", True),
    (("^app$", "^tier$"), "tier", True),
    (("^app$", "^tier$"), "environment", False),
    (("^(app|tier|version)$",), "app", True),
    (("^(app|tier|version)$",), "tier", True),
    (("^(app|tier|version)$",), "environment", False),
    ((r"^app\.kubernetes\.io/.*",), "app.kubernetes.io/name", True),
    ((r"^app\.kubernetes\.io/.*",), "app.kubernetes.io/version", True),
    ((r"^app\.kubernetes\.io/.*",), "custom-label", False),
    (("^app$", "^tier$"), "build-id", False),
    (("^app$", "^tier$"), "pod-template-hash", False),
)

# The same file, TestGetPodMetadata_WithLabelFiltering: (allowlist, the pod's labels, the series labels).
POD_LABELS = (
    ((), {"app": "nginx", "tier": "frontend", "app.kubernetes.io/name": "my-app", "app.kubernetes.io/version": "1.0.0"},
     {"app": "nginx", "tier": "frontend", "app_kubernetes_io_name": "my-app", "app_kubernetes_io_version": "1.0.0"}),
    (("^app$",), {"app": "nginx", "tier": "frontend"}, {"app": "nginx"}),
    ((r"^app\.kubernetes\.io/.*",),
     {"app": "nginx", "tier": "frontend", "app.kubernetes.io/name": "my-app", "app.kubernetes.io/version": "1.0.0",
      "build-id": "abc123"},
     {"app_kubernetes_io_name": "my-app", "app_kubernetes_io_version": "1.0.0"}),
    (("^app$", "^tier$", "^environment$"),
     {"app": "nginx", "tier": "frontend", "environment": "prod", "build-id": "abc123", "pod-template-hash": "xyz789"},
     {"app": "nginx", "tier": "frontend", "environment": "prod"}),
    ((r"^app\.kubernetes\.io/.*", "^version$"),
     {"app.kubernetes.io/name": "my-app", "app.kubernetes.io/component": "backend",
      "app.kubernetes.io/version": "2.0.0", "version": "v2", "build-id": "xyz", "controller-revision-hash": "abc"},
     {"app_kubernetes_io_name": "my-app", "app_kubernetes_io_component": "backend",
      "app_kubernetes_io_version": "2.0.0", "version": "v2"}),
    (("^nonexistent$",), {"app": "nginx", "tier": "frontend"}, {}),
)

# internal/pkg/utils/utils_test.go, TestSanitizeLabelName: (key, label name).
SANITIZED = (
    ("label.with.dots/and-slashes", "label_with_dots_and_slashes"),
    ("label@with#special!chars", "label_with_special_chars"),
    ("valid_label_name", "valid_label_name"),
)

# internal/pkg/transformation/hpc_test.go, TestGetGPUFiles: (directory entries, the mapping files among them).
HPC_FILES = (
    (("0", "1", "42"), ("0", "1", "42")),
    (("0.0", "2.1", "3.10"), ("0.0", "2.1", "3.10")),
    (("0", "1", "2.0", "3.1"), ("0", "1", "2.0", "3.1")),
    (("foo", "bar.txt", ".gitkeep"), ()),
    (("1e5", "NaN", "Inf", "+3", "-2", ".5"), ()),
    (("1.2.3", "0.1.2"), ()),
    (("0", "NaN", "2.0", "foo", "1e5", "3"), ("0", "2.0", "3")),
)

# The same file, TestHPCProcess: files (name, content) and the jobs each GPU's series get: GPU 0 one job,
# GPU 1 two, GPU 2 none (its series unchanged), GPU 3's GPU instance 0 one (its file 3.0, no newline at the end).
HPC_MAPPING = {"0": "job1-0\n", "1": "job1-1\njob2-1\n", "3.0": "job3.0-0"}
HPC_JOBS = {"0": ("job1-0",), "1": ("job1-1", "job2-1"), "3.0": ("job3.0-0",)}

# internal/pkg/transformation/pidmapper_test.go, TestExtractPodUID: (cgroup path, the pod UID in it).
POD_UID_PATHS = (
    ("/kubepods/besteffort/poda9c80282-3f6b-4d5b-84d5-a137a6668011/container123",
     "a9c80282-3f6b-4d5b-84d5-a137a6668011"),
    ("/kubepods/burstable/pod12345678-1234-1234-1234-123456789012/abc", "12345678-1234-1234-1234-123456789012"),
    ("/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-poda9c80282_3f6b_4d5b_84d5_a137a6668011.slice",
     "a9c80282-3f6b-4d5b-84d5-a137a6668011"),
    ("/system.slice/docker.service", ""),
    ("/kubepods/pod123/container", ""),
    ("", ""),
)

# internal/pkg/collector/clock_events_collector.go: the reason bits and their names.
CLOCK_EVENTS = {0x1: "gpu_idle", 0x2: "clocks_setting", 0x4: "power_cap", 0x8: "hw_slowdown", 0x10: "sync_boost",
                0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clocks"}
# internal/pkg/collector/p2p_status_collector.go, p2pStatusToString: status number -> link_status.
LINK_STATUS = {0: "OK", 1: "ChipsetNotSupported", 2: "GPUNotSupported", 3: "TopologyNotSupported",
               4: "DisabledByRegKey", 5: "NotSupported", 6: "Unknown", 7: "Unknown"}
# internal/pkg/collector/gpu_health_collector.go, gpuHealthChecks: the watches, in order.
HEALTH_WATCHES = ("PCIE", "NVLINK", "PMU", "MCU", "MEM", "SM", "INFOROM", "THERMAL", "POWER", "DRIVER", "ALL")
