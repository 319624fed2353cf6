#!/usr/bin/env python3
"""Release a real CUDA process that ignores SIGTERM and holds ~20 GiB; time the call to memory freed.

Runs on a GPU host (python3 with torch CUDA and nvidia-ml-py, root). It starts two CUDA processes:
  - the holder: allocates --gib GiB, ignores SIGTERM, command line carries a random marker;
  - the decoy: allocates a little, its command line does not match; it must survive.
Then it calls the gpu_release module_utils logic (the code the Ansible module runs) with the
default device glob /dev/nvidia*, the holder's marker as the only pattern and allow_foreign=true,
and reports how long the call took until NVML showed the memory free. Only processes this script
started can match the marker; the script kills nothing else, and ends both children itself.

    python3 benchmarks/gpu_release_h200.py             # on the GPU host; JSON on stdout
    python3 benchmarks/gpu_release_h200.py --dry-run   # anywhere: check mode, no CUDA, kills nothing

The JSON is also written to $OUT/gpu_release_h200.json when OUT is set.
"""

import argparse
import importlib.util
import json
import os
import select
import subprocess
import sys
import threading
import uuid
from pathlib import Path

UTILS = (
    Path(__file__).resolve().parents[1]
    / "collections/ansible_collections/specops/drafter/plugins/module_utils/gpus/gpu_release.py"
)

HOLDER = r"""
import signal, sys, time
mode, gib = sys.argv[1], float(sys.argv[2])
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
import torch
block = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
block.fill_(1)
torch.cuda.synchronize()
print("ready", flush=True)
while True:
    time.sleep(1)
"""


# Runs release() in its own process, as the Ansible module does: the holders this script starts
# are then not descendants of the caller (the module never signals its own process tree).
RELEASER = r"""
import importlib.util, json, sys, time
spec = importlib.util.spec_from_file_location("gpu_release_utils", sys.argv[1])
gr = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gr)
params = json.loads(sys.stdin.read())
t_call = time.monotonic()
try:
    result, error = gr.release(params), None
except gr.GpuReleaseError as exc:
    result, error = exc.result, exc.msg
result["call_s"] = round(time.monotonic() - t_call, 3)
result["error"] = error
print(json.dumps(result))
"""


def load_utils():
    spec = importlib.util.spec_from_file_location("gpu_release_utils", UTILS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def start_holder(mode, gib, marker, timeout=120):
    """Start a CUDA process and wait until its memory is allocated."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, mode, str(gib), marker],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline().decode().strip() if ready else ""
    if line != "ready":
        proc.kill()
        proc.wait()
        raise RuntimeError(
            f"{mode} CUDA process did not allocate {gib} GiB within {timeout} s (exit {proc.poll()})"
        )
    return proc


def gpu_memory(gr):
    nvml = gr.Nvml()
    try:
        return nvml.read()
    finally:
        nvml.close()


def emit(result, code=0):
    text = json.dumps(result, indent=2, sort_keys=True)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_release_h200.json").write_text(text + "\n")
    sys.exit(code)


def dry_run(gr, marker):
    """Check mode with the real device glob: shows what the host has, signals nothing."""
    params = {
        "patterns": [marker],
        "device_pattern": gr.DEFAULT_DEVICE_PATTERN,
        "protected": list(gr.DEFAULT_PROTECTED),
        "allow_foreign": True,
        "nvml": "auto",
    }
    result = gr.release(params, check_mode=True)
    emit({"mode": "dry-run", "pynvml": gr.HAS_PYNVML, "result": result})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=20.0, help="GiB the SIGTERM-ignoring holder allocates")
    parser.add_argument("--decoy-gib", type=float, default=0.5, help="GiB the decoy allocates")
    parser.add_argument("--grace", type=float, default=2.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--dry-run", action="store_true", help="check mode only: no CUDA, nothing signalled")
    args = parser.parse_args()

    gr = load_utils()
    token = uuid.uuid4().hex[:12]
    marker = f"specops-bench-holder-{token}"
    if args.dry_run:
        dry_run(gr, marker)
    if not gr.HAS_PYNVML:
        emit(
            {"error": "pynvml is not importable: install nvidia-ml-py; this benchmark needs an NVIDIA GPU"}, 2
        )
    try:
        idle_gpus, _ = gpu_memory(gr)
    except Exception as exc:  # noqa: BLE001 - any NVML failure means there is no GPU to measure
        emit({"error": f"NVML did not initialise ({exc}): no NVIDIA GPU or driver here; try --dry-run"}, 2)
    if not idle_gpus:
        emit({"error": "NVML sees no GPU: nothing to measure; try --dry-run"}, 2)

    children = []
    try:
        decoy = start_holder("term", args.decoy_gib, f"specops-bench-decoy-{token}")
        children.append(decoy)
        holder = start_holder("stubborn", args.gib, marker)
        children.append(holder)
        # PID 1 reaps a real orphaned worker; here we are the parent, so reap as soon as it dies.
        reaper = threading.Thread(target=holder.wait, daemon=True)
        reaper.start()
        before_gpus, before_procs = gpu_memory(gr)
        # Free means: back to the idle reading plus 1 GiB, once the decoy's own memory is left out.
        threshold = max(g["used_mb"] for g in idle_gpus) + 1024
        params = {
            "patterns": [marker],
            "device_pattern": gr.DEFAULT_DEVICE_PATTERN,
            "protected": list(gr.DEFAULT_PROTECTED),
            "allow_foreign": True,
            "orphans": True,
            "grace": args.grace,
            "timeout": args.timeout,
            "memory_threshold_mb": threshold,
            "nvml": "true",
        }
        releaser = subprocess.run(
            [sys.executable, "-c", RELEASER, str(UTILS)],
            input=json.dumps(params),
            capture_output=True,
            text=True,
            timeout=args.grace + 2 * args.timeout + 30,
        )
        if releaser.returncode != 0:
            raise RuntimeError(f"release crashed (exit {releaser.returncode}): {releaser.stderr[-2000:]}")
        result = json.loads(releaser.stdout.strip().splitlines()[-1])
        error, call_s = result["error"], result["call_s"]
        reaper.join(timeout=5)
        after_gpus, after_procs = gpu_memory(gr)
        killed = {entry["pid"]: entry for entry in result.get("killed", [])}
        decoy_alive = decoy.poll() is None
        summary = {
            "mode": "measure",
            "error": error,
            "gpu": before_gpus[0]["name"] if before_gpus else None,
            "holder": {
                "pid": holder.pid,
                "gib": args.gib,
                "ignores_sigterm": True,
                "exit": holder.returncode,
            },
            "decoy": {
                "pid": decoy.pid,
                "gib": args.decoy_gib,
                "alive_after": decoy_alive,
                "still_listed_by_nvml": decoy.pid in after_procs,
            },
            "ok": error is None
            and set(killed) == {holder.pid}
            and decoy_alive
            and killed[holder.pid]["signal"] == "SIGKILL",
            "grace_s": args.grace,
            "memory_threshold_mb": threshold,
            "call_to_memory_free_s": round(call_s, 3),
            "sigkill_to_memory_free_s": (
                round(result["timeline"]["memory_free_s"] - result["timeline"]["sigkill_s"], 3)
                if result.get("timeline", {}).get("memory_free_s") is not None
                and "sigkill_s" in result.get("timeline", {})
                else None
            ),
            "used_mb_idle": [g["used_mb"] for g in idle_gpus],
            "used_mb_before": [g["used_mb"] for g in before_gpus],
            "used_mb_after": [g["used_mb"] for g in after_gpus],
            "holder_listed_by_nvml_before": holder.pid in before_procs,
            "killed": result.get("killed"),
            "foreign": [
                {"pid": f["pid"], "cmdline": (f["cmdline"] or "")[:80]} for f in result.get("foreign", [])
            ],
            "protected": [
                {"pid": p["pid"], "cmdline": p["cmdline"][:80]} for p in result.get("protected", [])
            ],
            "timeline": result.get("timeline"),
            "module_elapsed_s": result.get("elapsed_s"),
        }
    except RuntimeError as exc:
        summary = {"mode": "measure", "error": str(exc), "ok": False}
    finally:
        # Only the two processes this script started.
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait()
    emit(summary, 0 if summary.get("ok") else 1)


if __name__ == "__main__":
    main()
