"""Build a Qwen3.5/3.6-style target from config (random weights, bf16) and its drafter, of a given size.

python benchmarks/build_target.py --size 2b|14b --tokenizer DIR --out DIR [--device cuda]

  2b   2.5 B parameters: the layers of a Qwen3.5-style 2 B model (hidden 2048, Gated DeltaNet with a
       full attention layer every 4, 16/32 linear heads of dim 128), the fixture tokenizer's vocabulary.
  14b  14.7 B parameters, 29 GB in bf16: Qwen3.6-27B's layers (hidden 5120, intermediate 17408, 16/48
       linear heads of dim 128, gated full attention with 24/4 heads of dim 256 every 4th layer) and its
       vocabulary of 248,320, with half of its 64 layers.
Writes DIR/target (save_pretrained, safetensors) and DIR/drafter (a random DFlash drafter on the
target's layers, the fixtures' small shape), then DIR/built.json. With --real-drafter, also
DIR/drafter_real: a random drafter of the real DFlash drafter's shape for Qwen3.6-27B (5 layers, 32/8
heads of 128, intermediate 17408, block 16, bf16: 1.6 B parameters, as benchmarks/score_real_h200.py
measures), for scoring at the real shape inside the window (#42's rehearsal); built on its own when
the target is there already. The development server serves the target with the fixture
tokenizer: where the vocabulary is larger than the tokenizer's, the lm_head's rows past the tokenizer
are zero, so greedy decoding never picks a token the tokenizer cannot decode (some logit of a known
token is positive).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specops.fixtures.__main__ import hide_gpu_kernels

SIZES = {
    "2b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
    ),
    "14b": dict(
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=32,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        vocab_size=248320,
    ),
}


def real_drafter_shape() -> dict:
    """The real DFlash drafter's shape for Qwen3.6-27B, from the one table that scoring at that shape
    measures (score_real_h200.py, REAL), as drafter_config's arguments."""
    from score_real_h200 import N_FEATURES, REAL

    return dict(
        num_layers=REAL["layers"],
        block_size=REAL["block"],
        num_target_features=N_FEATURES,
        num_attention_heads=REAL["heads"],
        num_key_value_heads=REAL["kv_heads"],
        head_dim=REAL["head_dim"],
        intermediate_size=REAL["intermediate"],
        torch_dtype=REAL["dtype"],
    )


# Fewer parameters than this means the config is not the size it is named after.
MIN_PARAMETERS = {"2b": 2e9, "14b": 14e9}


def target_config(size: str, tokenizer_size: int, eos_token_id: int, pad_token_id: int):
    from transformers import Qwen3_5TextConfig

    shape = dict(SIZES[size])
    layers = shape["num_hidden_layers"]
    return Qwen3_5TextConfig(
        vocab_size=shape.pop("vocab_size", tokenizer_size),
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        dtype="bfloat16",
        **shape,
    )


def build_real_drafter(out: Path) -> None:
    """DIR/drafter_real, once the target's config is there (built first where it is not)."""
    from specops.fixtures.drafter import build_random_drafter

    target = out / "target"
    if not (target / "config.json").is_file():
        return  # main() builds the target, then comes back here
    from transformers import AutoTokenizer

    mask_id = AutoTokenizer.from_pretrained(str(target)).convert_tokens_to_ids("<|mask|>")
    started = time.perf_counter()
    build_random_drafter(out / "drafter_real", target, mask_id, seed=2, **real_drafter_shape())
    print(json.dumps({"drafter_real_s": round(time.perf_counter() - started, 1)}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", choices=sorted(SIZES), default="2b")
    parser.add_argument("--tokenizer", required=True, help="a directory with the fixture tokenizer")
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--real-drafter", action="store_true", help="also write DIR/drafter_real")
    args = parser.parse_args()
    out = Path(args.out)
    if args.real_drafter and not (out / "drafter_real" / "config.json").is_file():
        build_real_drafter(out)
    if (out / "built.json").is_file():
        print((out / "built.json").read_text())
        return 0
    hide_gpu_kernels()  # nothing runs a forward here; keep fla out of the build all the same
    import torch
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM

    from specops.fixtures.drafter import build_random_drafter

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    config = target_config(args.size, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    config.architectures = ["Qwen3_5ForCausalLM"]
    torch.manual_seed(0)
    # Built in bf16 directly: a 14.7 B model in fp32 would take 59 GB of the device for a moment.
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(args.device):
            model = Qwen3_5ForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    with torch.no_grad():
        model.lm_head.weight[len(tokenizer) :] = 0
    parameters = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out / "target", safe_serialization=True)
    tokenizer.save_pretrained(out / "target")
    mask_id = tokenizer.convert_tokens_to_ids("<|mask|>")
    build_random_drafter(out / "drafter", out / "target", mask_id, seed=1, num_target_features=5)
    built = {
        "size": args.size,
        "parameters": parameters,
        "build_s": round(time.perf_counter() - started, 1),
        "weights_bytes": sum(f.stat().st_size for f in (out / "target").glob("*.safetensors")),
    }
    if args.real_drafter:
        build_real_drafter(out)
    (out / "built.json").write_text(json.dumps(built))
    print(json.dumps(built))
    return 0 if parameters >= MIN_PARAMETERS[args.size] else 1


if __name__ == "__main__":
    sys.exit(main())
