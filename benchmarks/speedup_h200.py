"""Calibrate the expected-speedup model (specops.speedup) on the development server's speculative decoding.

For each simulated acceptance length a, the development server's DFlash speculator
(specops.devserver.speculative) decodes the same prompt while the drafter really runs every step
(its cost is real) but its proposal is replaced by the target's own greedy continuation for the
first a - 1 drafts and a wrong token after: tau is then set by the experiment, not by how well a
random drafter guesses. Plain decoding is the development server's non-speculative path
(transformers' generate with a KV cache). Measured per run:

    decode step   plain decode time per output token (prefill excluded)
    draft_cost    mean drafter step / decode step      verify_cost   mean verify step / decode step
    measured      plain time per token / speculative time per token (prefill excluded)
    predicted     tau / (draft_cost + verify_cost)                       (the report's model, costs measured)
    estimated     tau / (weight-bytes draft_cost + 1)                    (the report's model, costs estimated)

The development server's verify recomputes the whole sequence (no KV cache), so its verify_cost is
far above SGLang's; the point is whether the model, given a server's step costs, predicts its speedup.

    python benchmarks/speedup_h200.py [--device cuda] [--tokens 192] [--out benchmarks/speedup_h200.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Timed:
    """Wraps a method, recording the wall time of each call (the device synchronised around it)."""

    def __init__(self, obj, name: str, device: str):
        self.calls: list[float] = []
        self.original = getattr(obj, name)
        self.device = device
        setattr(obj, name, self)

    def __call__(self, *args, **kwargs):
        sync(self.device)
        start = time.perf_counter()
        out = self.original(*args, **kwargs)
        sync(self.device)
        self.calls.append(time.perf_counter() - start)
        return out


def plain_decode(model, prompt: list[int], tokens: int, device: str) -> tuple[list[int], float]:
    """Greedy continuation and seconds per output token after the first (the prefill's)."""
    ids = torch.tensor([prompt], device=device)

    def run(n: int) -> tuple[torch.Tensor, float]:
        sync(device)
        start = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        sync(device)
        return out, time.perf_counter() - start

    run(4)  # warm up kernels and allocator
    _, prefill = run(1)
    out, total = run(tokens)
    return out[0, len(prompt) :].tolist(), (total - prefill) / (tokens - 1)


def speculative(
    speculator, model, prompt: list[int], reference: list[int], accept: int, tokens: int, device: str
) -> dict:
    """One speculative decode whose drafts match the reference for accept - 1 tokens, then miss."""
    vocab = speculator.head.vocab_size
    real_drafts = speculator._drafts

    def drafts(features, token, start):
        proposed = real_drafts(features, token, start)  # the drafter's real cost
        position = start - len(prompt) + 1  # index in reference of the token after start
        oracle = reference[position : position + len(proposed)]
        oracle += [0] * (len(proposed) - len(oracle))
        return [t if j < accept - 1 else (oracle[j] + 1) % vocab for j, t in enumerate(oracle)]

    speculator._drafts = drafts
    draft_timer = Timed(speculator, "_drafts", device)
    verify_timer = Timed(speculator, "_target", device)
    sync(device)
    start = time.perf_counter()
    outcome = speculator.generate(model, prompt, tokens, stop_ids=[])
    sync(device)
    total = time.perf_counter() - start
    speculator._drafts, speculator._target = real_drafts, verify_timer.original
    prefill = verify_timer.calls[0]
    if outcome.output_ids != reference[:tokens]:
        raise AssertionError(f"accept {accept}: speculative output differs from plain greedy decoding")
    return {
        "verify_ct": outcome.verify_ct,
        "tau": (len(outcome.output_ids) - 1) / outcome.verify_ct,
        "seconds_per_token": (total - prefill) / (len(outcome.output_ids) - 1),
        "draft_step_s": statistics.mean(draft_timer.calls),
        "verify_step_s": statistics.mean(verify_timer.calls[1:]),
    }


def summary(
    args: argparse.Namespace, prompt_tokens: int, decode_s: float, estimated: dict, rows: list[dict]
) -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else platform.processor(),
        "torch": torch.__version__,
        "setup": {
            "models": "fixture target (Qwen3.5-style, float32) and a random DFlash drafter",
            "kernels": args.kernels,
            "block": args.block,
            "tokens": args.tokens,
            "prompt_tokens": prompt_tokens,
        },
        "decode_step_s": decode_s,
        "estimated_costs": estimated,
        "runs": rows,
        "max_abs_predicted_error": max(abs(r["predicted_error"]) for r in rows),
        "max_abs_estimated_error": max(abs(r["estimated_error"]) for r in rows),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=192, help="output tokens per decode")
    parser.add_argument("--block", type=int, default=16, help="--speculative-num-draft-tokens")
    parser.add_argument("--accept", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_suffix(".json"))
    parser.add_argument(
        "--kernels",
        choices=("torch", "fla"),
        default="torch",
        help="gated_delta_rule kernels of the fixture target; fla's triton kernels tune "
        "themselves for every new length, and every verify here brings one",
    )
    args = parser.parse_args()
    if args.kernels == "torch":
        sys.modules["fla"] = None  # type: ignore[assignment]  # transformers then picks its torch path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specops import speedup as spd
    from specops.devserver.speculative import DFlashSpeculator
    from specops.fixtures.build import build_fixtures

    with tempfile.TemporaryDirectory() as scratch:
        paths = build_fixtures(Path(scratch) / "models", train_reference=False)
        tokenizer = AutoTokenizer.from_pretrained(paths.target)
        # float32, as the development server loads its model (devserver/engine.py)
        model = AutoModelForCausalLM.from_pretrained(paths.target).to(args.device).eval()
        speculator = DFlashSpeculator.load(paths.drafter, paths.target, model.config, args.block, args.device)
        estimated = spd.estimated_costs(paths.target, paths.drafter)
        prompt = tokenizer.encode("def fizzbuzz(n):\n    for i in range(1, n + 1):")
        with torch.inference_mode():
            reference, decode_s = plain_decode(model, prompt, args.tokens, args.device)
            speculative(speculator, model, prompt, reference, 2, 16, args.device)  # warm up
            rows = []
            for accept in args.accept:
                run = speculative(
                    speculator, model, prompt, reference, min(accept, args.block), args.tokens, args.device
                )
                draft_cost, verify_cost = run["draft_step_s"] / decode_s, run["verify_step_s"] / decode_s
                measured = decode_s / run["seconds_per_token"]
                predicted = spd.expected_speedup(run["tau"], draft_cost, verify_cost)
                estimate = spd.expected_speedup(run["tau"], **estimated)
                rows.append(
                    {
                        "simulated_accept": accept,
                        **run,
                        "draft_cost": draft_cost,
                        "verify_cost": verify_cost,
                        "measured_speedup": measured,
                        "predicted_speedup": predicted,
                        "predicted_error": predicted / measured - 1,
                        "estimated_speedup": estimate,
                        "estimated_error": estimate / measured - 1,
                    }
                )
                shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()}
                print(json.dumps(shown), flush=True)
                # Written after every run, so a run cut short still leaves what it measured.
                result = summary(args, len(prompt), decode_s, estimated, rows)
                args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
