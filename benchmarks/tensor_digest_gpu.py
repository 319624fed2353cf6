"""The development server's `/weights_checker` digest on a GPU (specops.devserver.tensor_digest).

    PYTHONPATH=src python3 benchmarks/tensor_digest_gpu.py [--gib 8] [--out FILE]

Checks that the hash computed on the device equals the same arithmetic on the CPU for the same bytes
(int64 wraps alike on both), that a changed element changes it, and times it over --gib GiB of bf16
weights, as the checker hashes a target's weights before and after a window.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

try:
    import specops  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

from specops.devserver import tensor_digest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0, help="GiB of bf16 weights to hash")
    parser.add_argument("--out", help="JSON file (default $OUT/tensor_digest_gpu.json when OUT is set)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    small = torch.randn(3 << 20, dtype=torch.bfloat16, device="cuda")  # 6 MiB, several chunks
    same_on_both = tensor_digest.device_hash(small) == tensor_digest.device_hash(small.cpu())
    changed = small.clone()
    changed[12345] += 1
    tells_a_change = tensor_digest.device_hash(changed) != tensor_digest.device_hash(small)
    weights = torch.empty(int(args.gib * 2**30) // 2, dtype=torch.bfloat16, device="cuda").normal_()
    tensor_digest.digest(weights[: 1 << 20])
    torch.cuda.synchronize()
    started = time.perf_counter()
    value = tensor_digest.digest(weights)
    seconds = time.perf_counter() - started
    record = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "device_hash_equals_cpu_arithmetic": same_on_both,
        "a_changed_element_changes_it": tells_a_change,
        "gib": args.gib,
        "seconds": seconds,
        "gib_per_s": args.gib / seconds,
        "digest": value,
        "ok": same_on_both and tells_a_change and len(value) == 16,
    }
    out = args.out or (
        os.path.join(os.environ["OUT"], "tensor_digest_gpu.json") if os.environ.get("OUT") else None
    )
    if out:
        Path(out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    sys.exit(0 if record["ok"] else 1)


if __name__ == "__main__":
    main()
