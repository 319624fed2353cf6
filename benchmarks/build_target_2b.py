"""Build a target of more than 2 B parameters from config (random weights, bf16) and its drafter.

python benchmarks/build_target_2b.py --tokenizer DIR --out DIR [--device cuda]

The layers have the shapes of a Qwen3.5-style 2 B model (hidden 2048, Gated DeltaNet with a full
attention layer every 4, 16/32 linear heads of dim 128); the vocabulary is the fixture tokenizer's, so
the development server can serve it and its completions decode. Writes DIR/target (save_pretrained,
safetensors) and DIR/drafter (a random DFlash drafter on the target's layers), then DIR/built.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specops.fixtures.__main__ import hide_gpu_kernels


def config_2b(vocab_size: int, eos_token_id: int, pad_token_id: int):
    from transformers import Qwen3_5TextConfig

    layers = 32
    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        dtype="bfloat16",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokenizer", required=True, help="a directory with the fixture tokenizer")
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    out = Path(args.out)
    if (out / "built.json").is_file():
        print((out / "built.json").read_text())
        return 0
    hide_gpu_kernels()  # nothing runs a forward here; keep fla out of the build all the same
    import torch
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM

    from specops.fixtures.drafter import build_random_drafter

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    config = config_2b(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    config.architectures = ["Qwen3_5ForCausalLM"]
    torch.manual_seed(0)
    with torch.device(args.device):
        model = Qwen3_5ForCausalLM(config).to(torch.bfloat16)
    parameters = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out / "target", safe_serialization=True)
    tokenizer.save_pretrained(out / "target")
    mask_id = tokenizer.convert_tokens_to_ids("<|mask|>")
    build_random_drafter(out / "drafter", out / "target", mask_id, seed=1, num_target_features=5)
    built = {
        "parameters": parameters,
        "build_s": round(time.perf_counter() - started, 1),
        "weights_bytes": sum(f.stat().st_size for f in (out / "target").glob("*.safetensors")),
    }
    (out / "built.json").write_text(json.dumps(built))
    print(json.dumps(built))
    return 0 if parameters >= 2e9 else 1


if __name__ == "__main__":
    sys.exit(main())
