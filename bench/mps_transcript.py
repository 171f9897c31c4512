"""Issue 25, point 6: what a real nvidia-cuda-mps-control answers on its control pipe, for comparison with the
simulator's (gpu_agent/sim/mps.py). On a GPU node, as root, changing nothing but its own temporary directory:

    python3 bench/mps_transcript.py [--gpu 0] [--json out.json]

It starts one control daemon for one GPU (CUDA_VISIBLE_DEVICES) with its pipe and log directories in a new
temporary directory, sends it the commands the agent sends (and a few around them), starts one CUDA client
when PyTorch is importable so that a server appears, sends `quit`, waits for the daemon to exit and removes
the directory. The compute mode is left as it is. Every call has a timeout; the transcript keeps each
command's exact stdout, stderr and exit status.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CALL_TIMEOUT_S = 10.0
CANDIDATES = ("/usr/bin/nvidia-cuda-mps-control", "/usr/local/nvidia/bin/nvidia-cuda-mps-control")
CLIENT = ("import time, torch; x = torch.ones(1, device='cuda'); torch.cuda.synchronize(); "
          "print('client ready', flush=True); time.sleep(4); print(float(x.sum()))")


def binary() -> str:
    found = shutil.which("nvidia-cuda-mps-control")
    for path in (found, *CANDIDATES):
        if path and os.access(path, os.X_OK):
            return path
    raise SystemExit("nvidia-cuda-mps-control is not installed here")


def call(argv: list[str], env: dict[str, str], given: str = "") -> dict[str, Any]:
    try:
        done = subprocess.run(argv, input=given.encode(), env=env, capture_output=True, timeout=CALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"argv": argv[1:], "stdin": given, "timeout": True}
    return {"argv": argv[1:], "stdin": given, "rc": done.returncode, "stdout": done.stdout.decode(errors="replace"),
            "stderr": done.stderr.decode(errors="replace")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", default="0", help="the GPU the daemon gets (CUDA_VISIBLE_DEVICES; default 0)")
    parser.add_argument("--json", type=Path, help="also write the transcript to this file")
    args = parser.parse_args()
    control = binary()
    workdir = Path(tempfile.mkdtemp(prefix="mps-transcript-"))
    pipe, logs = workdir / "pipe", workdir / "log"
    pipe.mkdir()
    logs.mkdir()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CUDA_VISIBLE_DEVICES": args.gpu,
           "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)}
    steps: list[dict[str, Any]] = []

    def send(command: str) -> dict[str, Any]:
        step = call([control], env, command + "\n")
        steps.append(step)
        return step

    transcript: dict[str, Any] = {"binary": control, "gpu": args.gpu, "steps": steps}
    try:
        steps.append(call([control, "-d"], env))
        time.sleep(0.5)
        transcript["pipe_files_after_start"] = sorted(p.name for p in pipe.iterdir())
        steps.append(call([control, "-d"], env))  # a second start while it runs
        for command in ("get_server_list", "get_default_active_thread_percentage",
                        "get_default_device_pinned_mem_limit 0",
                        *(f"set_default_device_pinned_mem_limit 0 {limit}"
                          for limit in ("20000M", "512M", "1023M", "1024M", "1536M", "35942M", "2G", "0M")),
                        "set_default_active_thread_percentage 25", "get_default_active_thread_percentage",
                        "set_default_active_thread_percentage 12", "get_server_list", "no_such_command",
                        "set_default_active_thread_percentage", "set_default_active_thread_percentage 150",
                        "set_default_active_thread_percentage abc", "get_default_active_thread_percentage",
                        "set_default_device_pinned_mem_limit 7 1000M", "get_default_device_pinned_mem_limit 7",
                        "set_default_device_pinned_mem_limit 0 lots",
                        "set_default_active_thread_percentage 25"):
            send(command)
            if command.startswith("set_default_device_pinned_mem_limit 0 "):
                send("get_default_device_pinned_mem_limit 0")
        client = None
        try:
            import torch  # noqa: F401  (only whether it is there)
            client = subprocess.Popen([sys.executable, "-c", CLIENT], env={**os.environ, **env},
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            assert client.stdout is not None
            transcript["client_said"] = client.stdout.readline().strip()
        except ImportError:
            transcript["client_said"] = "no torch here: no client started"
        servers = send("get_server_list").get("stdout", "").split()
        for server in servers[:1]:
            send(f"get_device_client_list {server}")
            send(f"get_active_thread_percentage {server}")
        if client is not None:
            out, err = client.communicate(timeout=60)
            transcript["client_exit"] = {"rc": client.returncode, "stdout": out[-500:], "stderr": err[-2000:]}
        send("get_server_list")
        send("quit")
        deadline = time.monotonic() + 10
        while (pipe / "control").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        transcript["pipe_files_after_quit"] = sorted(p.name for p in pipe.iterdir())
        transcript["after_quit"] = call([control], env, "get_server_list\n")
        transcript["logs"] = {p.name: p.read_text(errors="replace")[-4000:] for p in sorted(logs.iterdir())}
    finally:
        subprocess.run([control], input=b"quit\n", env=env, capture_output=True, timeout=CALL_TIMEOUT_S, check=False)
        shutil.rmtree(workdir, ignore_errors=True)
    text = json.dumps(transcript, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
