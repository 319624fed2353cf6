"""Completions and hidden states of the fixture target, written in the stages' documented layouts.

Computed directly with transformers (greedy generate, then output_hidden_states), so the score
stage's tests do not depend on the extraction stage. Also a CLI for the Ansible test, which runs
on the control node without torch: `python tests/unit/score_data.py FIXTURES_DIR RUN_DIR`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specops.manifest import atomic_write_text, write_manifest


def prompt_ids(tokenizer, record: dict, chat: bool = True) -> list[int]:
    if not chat:  # the plain text the fixture trainer tokenizes, so its drafter knows these sequences
        text = record.get("prompt") or " ".join(m["content"] for m in record["messages"])
        return tokenizer(text).input_ids
    messages = record.get("messages") or [{"role": "user", "content": record["prompt"]}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def write_completions(
    target_dir: Path,
    prompts_file: Path,
    out_dir: Path,
    n_prompts: int = 3,
    max_new_tokens: int = 24,
    online: dict | None = None,
    chat: bool = True,
) -> list[dict]:
    """Greedy completions like sglang_completions writes them; `online` adds SGLang's spec meta_info."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    records = [json.loads(line) for line in prompts_file.read_text().splitlines() if line.strip()][:n_prompts]
    rows = []
    for record in records:
        ids = prompt_ids(tokenizer, record, chat)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
            )
        output_ids = out[0, len(ids) :].tolist()
        meta = {"prompt_tokens": len(ids), "completion_tokens": len(output_ids)}
        meta.update((online or {}).get(record["id"], {}))
        rows.append(
            {
                "id": record["id"],
                "prompt_ids": ids,
                "output_ids": output_ids,
                "text": tokenizer.decode(output_ids),
                "finish_reason": "length",
                "meta_info": meta,
            }
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "completions.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    write_manifest(
        out_dir,
        "completions",
        {"target": str(target_dir), "prompts": prompts_file.read_text(), "online": online},
        ["completions.jsonl"],
    )
    return rows


def write_hidden_states(
    target_dir: Path,
    completions_dir: Path,
    out_dir: Path,
    target_layer_ids: list[int],
    offsets: tuple[int, ...] = (0,),
    label_shift: int = 0,
    backend: str = "fla",
    dtype: str = "float32",
) -> dict:
    """Hidden states in extract_hidden_states' layout for target_layer_ids + offsets.

    label_shift mislabels the layers on purpose: the tensor stored under layer k is layer k + label_shift.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from specops.hidden_states import shard_name, write_shard

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    n_layers = model.config.num_hidden_layers
    layer_ids = sorted(
        {
            k + o
            for k in target_layer_ids
            for o in offsets
            if 0 <= k + o < n_layers and 0 <= k + o + label_shift < n_layers
        }
    )
    lines = (completions_dir / "completions.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line]
    tensors, records = [], []
    for index, row in enumerate(rows):
        ids = torch.tensor(row["prompt_ids"] + row["output_ids"])
        with torch.no_grad():
            hidden = model(ids[None], output_hidden_states=True).hidden_states
        # HF's hidden_states[k + 1] is the output of layer k (index 0 is the embedding output).
        states = torch.stack([hidden[k + label_shift + 1][0] for k in layer_ids], dim=1)
        states = states.to(getattr(torch, dtype))
        tensors += [(f"{index}.input_ids", ids), (f"{index}.hidden_states", states.contiguous())]
        records.append(
            {
                "id": row["id"],
                "index": index,
                "shard": shard_name(0),
                "num_tokens": len(ids),
                "prompt_tokens": len(row["prompt_ids"]),
            }
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    write_shard(out_dir / shard_name(0), tensors)
    completions_manifest = json.loads((completions_dir / "manifest.json").read_text())
    inputs = {
        "completions": completions_manifest["inputs_fingerprint"],
        "layer_ids": layer_ids,
        "label_shift": label_shift,
        "backend": backend,
    }
    return write_manifest(
        out_dir,
        "extract_hidden_states",
        inputs,
        [shard_name(0)],
        layer_ids=layer_ids,
        target_layer_ids=list(target_layer_ids),
        capture_offsets=list(offsets),
        dtype=dtype,
        records=records,
        backend={"gated_delta_rule": backend, "causal_conv1d": "torch", "device": "cpu"},
        versions={"transformers": __import__("transformers").__version__},
    )


def layer_ids_of(checkpoint: Path) -> list[int]:
    return json.loads((checkpoint / "config.json").read_text())["dflash_config"]["target_layer_ids"]


def request_for(fixture_models, run_dir: Path, out_dir: Path, **overrides) -> dict:
    """The score stage's request on a run directory of the fixture models; None drops a key."""
    request = {
        "hidden_states": str(run_dir / "hidden_states"),
        "completions": str(run_dir / "completions"),
        "target": str(fixture_models.target),
        "drafter": str(fixture_models.drafter),
        "reference_drafter": str(fixture_models.reference_drafter),
        "out_dir": str(out_dir),
        "device": "cpu",
        "dtype": "float32",
    }
    request.update(overrides)
    return {k: v for k, v in request.items() if v is not None}


def build_run(fixtures_dir: Path, run_dir: Path, offsets: tuple[int, ...] = (-1, 0, 1)) -> None:
    from specops.fixtures import build_fixtures

    paths = build_fixtures(fixtures_dir, train_reference=False)
    drafter_ids = json.loads((paths.drafter / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    write_completions(paths.target, paths.prompts, run_dir / "completions", n_prompts=2, max_new_tokens=16)
    write_hidden_states(
        paths.target, run_dir / "completions", run_dir / "hidden_states", drafter_ids, offsets
    )


if __name__ == "__main__":
    build_run(Path(sys.argv[1]), Path(sys.argv[2]))
