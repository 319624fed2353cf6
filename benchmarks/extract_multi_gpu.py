"""Extraction on two GPUs against one, on the same tokens, through the stage itself (`extract.run`).

    PYTHONPATH=src python3 benchmarks/extract_multi_gpu.py           # on a host with 2 GPUs, ~10 minutes
    PYTHONPATH=src python3 benchmarks/extract_multi_gpu.py --smoke   # tiny model, two CPU "devices"

Builds a random Qwen3.5-style model of ~2.7 B parameters from config (no download; the shape of
extract_h200.py) and saves it as a checkpoint, with random completions. Then, interleaved round by round
(so clock and thermal drift hit every variant alike) and reported as medians:
  one_gpu        devices [cuda:0], parallel single
  two_gpus_data  devices [cuda:0, cuda:1], parallel data: one model copy per GPU, the shards divided
  two_gpus_split devices [cuda:0, cuda:1], parallel split: the layers spread over both GPUs, forced
                 (the model fits on one), as a target too large for one GPU would be
Throughput is the tokens over the extraction proper (first batch to last shard written, without the
model load), as the manifest records it; the wall time of the whole stage is reported beside it.
Goal: two_gpus_data >= 1.85x one_gpu; the split run's states identical to one GPU's (and the data run's
too). Prints a table and writes everything to $OUT/extract_multi_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from specops import extract
from specops.fixtures.drafter import build_target_layer_ids
from specops.hidden_states import open_hidden_states

sys.path.insert(0, str(Path(__file__).resolve().parent))
from extract_h200 import filesystem_of, model_config, versions  # noqa: E402

TARGET_SPEEDUP = 1.85


def build_inputs(root: Path, smoke: bool, seqs: int, seq_len: int) -> tuple[Path, Path, list[int], int]:
    """A saved random target and its completions; returns (target, completions, layer ids, parameters)."""
    from transformers import Qwen3_5ForCausalLM

    config = model_config(smoke)
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config).to(torch.bfloat16 if not smoke else torch.float32)
    target = root / "target"
    model.save_pretrained(target, safe_serialization=True)
    parameters = sum(p.numel() for p in model.parameters())
    del model
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (seqs, seq_len), generator=generator)
    completions = root / "completions"
    completions.mkdir()
    with open(completions / "completions.jsonl", "w") as handle:
        for number, row in enumerate(tokens.tolist()):
            handle.write(
                json.dumps(
                    {
                        "id": f"seq-{number}",
                        "prompt_ids": row[: seq_len // 4],
                        "output_ids": row[seq_len // 4 :],
                    }
                )
                + "\n"
            )
    layer_ids = build_target_layer_ids(config.num_hidden_layers, 3 if smoke else 5)
    return target, completions, layer_ids, parameters


def states_of(directory: Path) -> dict[str, torch.Tensor]:
    return {str(meta["id"]): hidden for meta, _, hidden in open_hidden_states(directory, verify=True)}


def compare(candidate: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict:
    same_records = sorted(candidate) == sorted(reference)
    identical = same_records and all(torch.equal(candidate[k], reference[k]) for k in reference)
    diff = max(
        (
            float((candidate[k].float() - reference[k].float()).abs().max())
            for k in reference
            if k in candidate
        ),
        default=float("nan"),
    )
    return {"same_records": same_records, "identical": identical, "max_abs_diff": diff}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model on two CPU devices: code paths only")
    parser.add_argument("--seqs", type=int, help="sequences (default 256, smoke 12)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default 2048, smoke 48)")
    parser.add_argument("--batch-tokens", type=int, help="tokens per forward (default 8192, smoke 96)")
    parser.add_argument("--shard-tokens", type=int, help="tokens per shard (default 32768, smoke 96)")
    parser.add_argument(
        "--rounds", type=int, help="interleaved rounds; medians are reported (default 3, smoke 1)"
    )
    parser.add_argument(
        "--fsync",
        action="store_true",
        help="fsync every shard (default: leave the flushing to the OS, so the disk does not "
        "bound both runs)",
    )
    parser.add_argument("--scratch", help="directory for model and shards (default: a temporary dir)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="where extract_multi_gpu.json goes")
    args = parser.parse_args()
    smoke = args.smoke
    seqs = args.seqs or (12 if smoke else 256)
    seq_len = args.seq_len or (48 if smoke else 2048)
    batch_tokens = args.batch_tokens or (96 if smoke else 8192)
    shard_tokens = args.shard_tokens or (96 if smoke else 32768)
    rounds = args.rounds or (1 if smoke else 3)
    if smoke:
        gpus = ["cpu", "cpu"]
        torch.set_num_threads(1)  # as each CPU worker computes: sums in the same order, the same states
    else:
        if torch.cuda.device_count() < 2:
            print(f"this benchmark needs 2 GPUs; torch sees {torch.cuda.device_count()}", file=sys.stderr)
            return 2
        gpus = ["cuda:0", "cuda:1"]

    began = time.perf_counter()
    scratch = Path(args.scratch) if args.scratch else Path(tempfile.mkdtemp(prefix="extract-multi-"))
    scratch.mkdir(parents=True, exist_ok=True)
    target, completions, layer_ids, parameters = build_inputs(scratch, smoke, seqs, seq_len)
    result: dict = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "devices": [extract.describe_device(torch.device(d)) for d in gpus],
        "smoke": smoke,
        "versions": versions(),
        "command": " ".join(["benchmarks/extract_multi_gpu.py", *sys.argv[1:]]),
        "model": {
            "parameters": parameters,
            "layer_ids": layer_ids,
            "build_s": round(time.perf_counter() - began, 1),
        },
        "workload": {
            "sequences": seqs,
            "seq_len": seq_len,
            "tokens": seqs * seq_len,
            "batch_tokens": batch_tokens,
            "shard_tokens": shard_tokens,
            "rounds": rounds,
            "fsync": args.fsync,
        },
        "scratch_filesystem": filesystem_of(scratch),
    }
    base = {
        "target": str(target),
        "completions": str(completions),
        "layer_ids": layer_ids,
        "batch_tokens": batch_tokens,
        "shard_tokens": shard_tokens,
        "fsync": args.fsync,
        "require_backend": "any" if smoke else "fla",
        "parity_samples": 0,
    }
    variants = {
        "one_gpu": {"devices": gpus[:1], "parallel": "single"},
        "two_gpus_data": {"devices": gpus, "parallel": "data"},
        "two_gpus_split": {"devices": gpus, "parallel": "split"},
    }
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    checks: dict = {}
    for number in range(rounds):
        kept: dict[str, Path] = {}
        for name, options in variants.items():
            out_dir = scratch / f"{name}-{number}"
            started = time.perf_counter()
            summary = extract.run({**base, **options, "out_dir": str(out_dir)})
            wall = time.perf_counter() - started
            progress = summary["progress"]
            runs[name].append(
                {
                    "wall_s": round(wall, 3),
                    "tokens_per_s": round(progress["tokens_per_second"]),
                    "load_s": progress.get("load_s"),
                    "parallel": summary["parallel"],
                    "backend": summary["backend"],
                    "progress": progress,
                }
            )
            kept[name] = out_dir
            print(
                f"round {number} {name}: {progress['tokens_per_second']:.0f} tok/s, wall {wall:.1f}s",
                file=sys.stderr,
            )
        if number == 0:  # states are compared once (not timed)
            reference = states_of(kept["one_gpu"])
            checks["split_vs_one_gpu"] = compare(states_of(kept["two_gpus_split"]), reference)
            checks["data_vs_one_gpu"] = compare(states_of(kept["two_gpus_data"]), reference)
        for out_dir in kept.values():
            shutil.rmtree(out_dir)
        os.sync()  # the next variant starts with nothing left to flush

    table = {}
    for name, found in runs.items():
        rates = [r["tokens_per_s"] for r in found]
        walls = [r["wall_s"] for r in found]
        table[name] = {
            "tokens_per_s_median": round(statistics.median(rates)),
            "spread": round((max(rates) - min(rates)) / statistics.median(rates), 4),
            "wall_s_median": round(statistics.median(walls), 3),
        }
    one = table["one_gpu"]["tokens_per_s_median"]
    for row in table.values():
        row["vs_one_gpu"] = round(row["tokens_per_s_median"] / one, 4)
    result["table"] = table
    result["runs"] = runs
    result["checks"] = checks
    result["speedup_data"] = table["two_gpus_data"]["vs_one_gpu"]
    result["meets_target"] = result["speedup_data"] >= TARGET_SPEEDUP
    result["split_identical"] = checks["split_vs_one_gpu"]["identical"]
    result["wall_s"] = round(time.perf_counter() - began, 1)
    if not args.scratch:
        shutil.rmtree(scratch)

    text = json.dumps(result, indent=2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "extract_multi_gpu.json").write_text(text + "\n")
    print(text)
    print(f"\n{'variant':<16} {'tok/s':>9} {'spread':>7} {'wall s':>8} {'vs one':>7}")
    for name, row in table.items():
        print(
            f"{name:<16} {row['tokens_per_s_median']:>9} {row['spread']:>7.1%} "
            f"{row['wall_s_median']:>8.2f} {row['vs_one_gpu']:>6.3f}x"
        )
    verdict = "met" if result["meets_target"] else "NOT met"
    print(
        f"target {TARGET_SPEEDUP}x: data parallel {result['speedup_data']:.3f}x ({verdict}); split states "
        f"identical to one GPU's: {result['split_identical']} (max abs diff "
        f"{checks['split_vs_one_gpu']['max_abs_diff']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
