#!/bin/bash
# The developers' guide's real-GPU checklist, in one run on a node with an NVIDIA GPU and its driver loaded,
# as root, from a checkout (python3 with this project's dependencies importable):
#
#     OUT=/tmp/checklist bash bench/real_gpu_checklist.sh
#
#     STEPS="node check run" OUT=... bash bench/real_gpu_checklist.sh   # only these steps
#
# No module is loaded or unloaded, no MIG mode or instance, clock or power limit changes. The agent runs
# with the driver, toolkit and Kubernetes stages off; what it writes is its own (/run/gpu-agent, a socket
# under /run). The `mps` step starts one control daemon for GPU 0 in a temporary directory and quits it.
# The `mps-agent` step runs the agent with sharing.mps for a minute: it mounts its tmpfs at
# /run/nvidia/mps/shm, puts GPU 0 in EXCLUSIVE_PROCESS compute mode, runs one CUDA client through the
# daemon, then `gpu-agent uninstall` quits the daemon, unmounts and puts the compute mode back.
# Each step has a timeout; a failing step is reported and the next runs. Into $OUT: checklist.log,
# check.json, metrics.txt, gpu_rss.json, capture.tar.gz, mps.json, mig.txt, driver.json.
set -u
OUT=${OUT:-/tmp/gpu-agent-checklist}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
exec > >(tee "$OUT/checklist.log") 2>&1
cd "$(dirname "$0")/.."

STEPS=${STEPS:-node check driver run nvml-stop gpu-rss capture mig mps mps-agent}
step() { echo; echo "=== $* ($(date -u +%T))"; }
wanted() { [[ " $STEPS " == *" $1 "* ]]; }
ga() { timeout 120 "$PY" -m gpu_agent "$@"; }

# A config in a new $RUNDIR under /run (http.socket must be there) for the agent on a free loopback $PORT, with
# every stage that could change the host off (as bench/gpu_rss.py's), and what stdin adds.
agent_config() {
RUNDIR=$(mktemp -d "/run/$1.XXXXXX")
PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
{
    printf 'version: v1\nhttp:\n  listen: 127.0.0.1:%s\n  socket: %s/agent.sock\n' "$PORT" "$RUNDIR"
    printf 'driver:\n  enabled: false\ntoolkit:\n  enabled: false\nkubernetes:\n  enabled: false\n'
    cat
} > "$RUNDIR/config.yaml"
}

step_node() {
step "node"
uname -r
nvidia-smi --query-gpu=name,uuid,driver_version,mig.mode.current,compute_mode,persistence_mode,memory.total \
    --format=csv 2>&1
cat /sys/module/nvidia/version 2>&1
grep -i nvidia /proc/modules 2>&1
command -v nvidia-smi nvidia-cuda-mps-control 2>&1; ls /usr/local/nvidia/bin 2>&1 | head -20
"$PY" --version
}

step_check() {
step "check --json"
ga check --json > "$OUT/check.json"; echo "rc=$?"
"$PY" - "$OUT/check.json" <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
print(json.dumps({k: doc[k] for k in doc if k not in ("plan",)}, indent=1)[:6000])
EOF
}

step_driver() {
step "driver version detection"
{
    echo '{"check_driver": '
    "$PY" - "$OUT/check.json" <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
print(json.dumps([s for s in doc.get("stages", []) if s.get("stage", "").startswith("driver")], indent=1))
EOF
    echo ', "detected": '
    "$PY" - <<'EOF'
import dataclasses, json
from gpu_agent.host import driver_version
from gpu_agent.host.paths import Root
root = Root("/")
found = driver_version.installed(root)
print(json.dumps({"installed": dataclasses.asdict(found) if dataclasses.is_dataclass(found) else repr(found),
                  "library_version": driver_version.library_version(root),
                  "kernel_release": driver_version.kernel_release(root),
                  "module_path": driver_version.module_path(root)}, indent=1, default=str))
EOF
    echo ', "reload_dry_run": '
    ga driver reload --dry-run --json || echo '"rc='$?'"'
    echo '}'
} > "$OUT/driver.json"
cat "$OUT/driver.json"
}

step_run() {
step "run with /metrics"
agent_config gpu-agent-checklist <<EOF
metrics:
  sample_interval_seconds: 5
EOF
timeout 90 "$PY" -m gpu_agent --config "$RUNDIR/config.yaml" run > "$RUNDIR/agent.log" 2>&1 &
AGENT=$!
# work for the profiling counters (GPM) to see: bf16 matrix products for about 20 s
timeout 60 "$PY" -c '
import time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
end = time.monotonic() + 20
while time.monotonic() < end:
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
' > "$RUNDIR/load.log" 2>&1 &
"$PY" - "$PORT" "$OUT/metrics.txt" <<'EOF'
import json, sys, time, urllib.request
port, out = sys.argv[1], sys.argv[2]
base = f"http://127.0.0.1:{port}"
def get(path):
    try:
        with urllib.request.urlopen(base + path, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return None, str(e)
deadline = time.monotonic() + 60
while time.monotonic() < deadline and get("/readyz")[0] != 200:
    time.sleep(1)
print("readyz", get("/readyz"))
time.sleep(16)  # three sampling intervals, under load
code, text = get("/metrics")
open(out, "w").write(text)
names = sorted({line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")})
print("metrics", code, len(text), "bytes;", len(names), "series names")
print("DCGM:", [n for n in names if n.startswith("DCGM_FI_DEV")])
print("PROF:", [line for line in text.splitlines() if line.startswith("DCGM_FI_PROF")])
print("UTIL:", [line for line in text.splitlines() if line.startswith(("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_POWER"))])
print("other:", [n for n in names if not n.startswith("DCGM_FI_")])
code, status = get("/status")
print("status", code, status[:4000])
EOF
STOP=$(date +%s%N); kill -TERM $AGENT; wait $AGENT; echo "agent rc=$? $(( ($(date +%s%N) - STOP) / 1000000 )) ms after SIGTERM"
tail -30 "$RUNDIR/agent.log"; cat "$RUNDIR/load.log"
rm -rf "$RUNDIR"
}

step_gpu_rss() {
step "bench/gpu_rss.py"
timeout 150 "$PY" bench/gpu_rss.py --idle-seconds 30 --json "$OUT/gpu_rss.json"; echo "rc=$?"
}

step_capture() {
step "capture"
CAP=$(mktemp -d)
ga capture "$CAP/capture"; echo "rc=$?"
ls -la "$CAP/capture"; cat "$CAP/capture/manifest.json"
tar -czf "$OUT/capture.tar.gz" -C "$CAP" capture
ga --simulate "$CAP/capture" check > /dev/null; echo "replayed check rc=$?"
rm -rf "$CAP"
}

step_mig() {
step "mig export and apply --dry-run"
MIGCFG=$(mktemp)
cat > "$MIGCFG" <<'EOF'
version: v1
mig-configs:
  all-disabled:
    - devices: all
      mig-enabled: false
  all-enabled:
    - devices: all
      mig-enabled: true
      mig-devices: {}
  all-1g.10gb:
    - devices: all
      mig-enabled: true
      mig-devices:
        "1g.10gb": 7
  all-1g.18gb:
    - devices: all
      mig-enabled: true
      mig-devices:
        "1g.18gb": 7
  all-3g.71gb:
    - devices: all
      mig-enabled: true
      mig-devices:
        "3g.71gb": 2
EOF
{
    echo "--- mig export"; ga mig export; echo "rc=$?"
    for c in all-disabled all-enabled all-1g.10gb all-1g.18gb all-3g.71gb; do
        echo "--- mig apply --dry-run -c $c"; ga mig apply --dry-run --json -f "$MIGCFG" -c "$c"; echo "rc=$?"
    done
    echo "--- nvidia-smi after (unchanged)"
    nvidia-smi --query-gpu=mig.mode.current,mig.mode.pending --format=csv
} > "$OUT/mig.txt" 2>&1
cat "$OUT/mig.txt"
rm -f "$MIGCFG"
}

step_mps() {
step "MPS: a control daemon for GPU 0 in a temporary directory"
timeout 120 "$PY" bench/mps_transcript.py --gpu 0 --json "$OUT/mps.json" > /dev/null; echo "rc=$?"
cat "$OUT/mps.json" 2>/dev/null | head -150
nvidia-smi --query-gpu=compute_mode --format=csv
}

step_nvml_stop() {
step "nvmlShutdown while another thread waits for XID events (why the agent's stop warns)"
timeout 60 "$PY" - <<'EOF'
import threading, time, pynvml
pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByIndex(0)
events = pynvml.nvmlEventSetCreate()
pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, events)
def wait():
    start = time.monotonic()
    try:
        pynvml.nvmlEventSetWait_v2(events, 5000)
        print("wait returned an event")
    except pynvml.NVMLError as exc:
        print(f"wait: {exc} after {time.monotonic() - start:.2f} s")
waiter = threading.Thread(target=wait)
waiter.start()
time.sleep(0.5)
start = time.monotonic()
try:
    pynvml.nvmlShutdown()
    print(f"nvmlShutdown returned after {time.monotonic() - start:.2f} s, the wait still running: {waiter.is_alive()}")
except pynvml.NVMLError as exc:
    print(f"nvmlShutdown: {exc} after {time.monotonic() - start:.2f} s")
waiter.join()
print(f"the wait ended {time.monotonic() - start:.2f} s after nvmlShutdown began")
EOF
}

step_mps_agent() {
step "MPS through the agent: sharing.mps replicas 4 on GPU 0, one client, then uninstall"
agent_config gpu-agent-mps <<EOF
plugin:
  enabled: true
  sharing:
    mps:
      resources:
      - name: nvidia.com/gpu
        replicas: 4
EOF
nvidia-smi --query-gpu=compute_mode --format=csv,noheader
timeout 120 "$PY" -m gpu_agent --config "$RUNDIR/config.yaml" run > "$RUNDIR/agent.log" 2>&1 &
AGENT=$!
PIPE=$("$PY" -c 'from gpu_agent.mps.layout import pipe_dir; print(pipe_dir("nvidia.com/gpu"))')
timeout 90 "$PY" - "$PORT" "$PIPE" "$(command -v "$PY")" <<'EOF'
import json, os, subprocess, sys, time, urllib.request
port, pipe, python = sys.argv[1], sys.argv[2], sys.argv[3]
def status():
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as r:
            return json.loads(r.read())
    except (OSError, ValueError) as exc:
        return {"error": str(exc)}
deadline = time.monotonic() + 40
while time.monotonic() < deadline:
    mps = status().get("mps") or {}
    if any(d.get("pid") for d in mps.get("daemons", [])):
        break
    time.sleep(1)
print("mps:", json.dumps(status().get("mps"), indent=1))
print(subprocess.run(["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader"], capture_output=True,
                     text=True, timeout=20).stdout.strip())
print(open("/proc/self/mountinfo").read().count("/run/nvidia/mps/shm"), "mount(s) at /run/nvidia/mps/shm")
client = r"""
import torch
free, total = torch.cuda.mem_get_info()
print(f"client: device {torch.cuda.get_device_name(0)}, free {free >> 20} MiB of {total >> 20} MiB", flush=True)
x = torch.empty(20 << 30, dtype=torch.uint8, device="cuda"); torch.cuda.synchronize()
print("client: 20 GiB allocated", flush=True)
del x
try:
    y = torch.empty(40 << 30, dtype=torch.uint8, device="cuda"); torch.cuda.synchronize()
    print("client: 40 GiB allocated (over a quarter of the GPU)", flush=True)
except RuntimeError as exc:
    print("client: 40 GiB refused:", str(exc).splitlines()[0][:200], flush=True)
import time; time.sleep(3)
"""
env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": pipe}
proc = subprocess.Popen([python, "-m", "gpu_agent.mps.launch", "/run/nvidia/mps/shm", python, "-c", client], env=env,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
time.sleep(12)
control = {"CUDA_MPS_PIPE_DIRECTORY": pipe, "PATH": "/usr/bin:/bin:/usr/local/nvidia/bin"}
answer = subprocess.run(["nvidia-cuda-mps-control"], input="get_server_list\n", env=control, capture_output=True,
                        text=True, timeout=10)
print(f"get_server_list -> {answer.stdout!r} {answer.stderr!r}")
for server in answer.stdout.split():
    for query in (f"get_device_client_list {server}", f"get_active_thread_percentage {server}"):
        said = subprocess.run(["nvidia-cuda-mps-control"], input=query + "\n", env=control, capture_output=True,
                              text=True, timeout=10)
        print(f"{query} -> {said.stdout!r} {said.stderr!r}")
out, _ = proc.communicate(timeout=60)
print("client exit", proc.returncode, out[-3000:])
print("mps after:", json.dumps(status().get("mps"), indent=1))
EOF
kill -TERM $AGENT; wait $AGENT; echo "agent rc=$?"
tail -40 "$RUNDIR/agent.log"
ga --config "$RUNDIR/config.yaml" uninstall; echo "uninstall rc=$?"
nvidia-smi --query-gpu=compute_mode --format=csv,noheader
grep -c /run/nvidia/mps /proc/self/mountinfo; ls -la /run/nvidia/mps 2>&1; pgrep -a nvidia-cuda-mps
rm -rf "$RUNDIR"
}

for name in $STEPS; do "step_${name//-/_}"; done
step "done"
ls -la "$OUT"
