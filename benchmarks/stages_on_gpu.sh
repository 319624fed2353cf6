#!/usr/bin/env bash
# The real stages on a GPU host, end to end on the small fixture models: extraction through
# `python -m specops.extract --run` (model loaded from its directory onto CUDA, fla required, parity
# probe against the fp32 torch fallback), then scoring on CUDA. Run on the H200 with the fla and
# transformers wheels in .whl/ (see benchmarks/README.md); results go to $OUT/stages_on_gpu.json.
set -euo pipefail
OUT=${OUT:-$(mktemp -d)}
WORK=$(mktemp -d)
DEVICE=${DEVICE:-cuda}    # DEVICE=cpu REQUIRE=any checks the script on a machine without a GPU
REQUIRE=${REQUIRE:-fla}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src
python3 -m specops.fixtures --out "$WORK/models" --no-reference-training >/dev/null
# Greedy completions in the stages' layout, generated on the CPU (the tiny model decodes faster there than
# triton tunes fla's kernels for every new length on the GPU). fla is hidden from this process: with fla
# importable, transformers would send CPU tensors to its kernels and crash.
python3 - "$WORK" cpu <<'PY'
import json, sys
sys.modules["fla"] = None  # importlib.util.find_spec("fla") now answers None: the torch path is chosen
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from specops.manifest import atomic_write_text, write_manifest
work, device = Path(sys.argv[1]), sys.argv[2]
target = work / "models/target"
tokenizer = AutoTokenizer.from_pretrained(target)
model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).to(device).eval()
rows = []
for line in (work / "models/prompts.jsonl").read_text().splitlines()[:4]:
    record = json.loads(line)
    ids = tokenizer(record.get("prompt") or record["messages"][-1]["content"]).input_ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids], device=device), max_new_tokens=64, min_new_tokens=64,
                             do_sample=False)
    output = out[0, len(ids):].tolist()
    rows.append({"id": record["id"], "prompt_ids": ids, "output_ids": output,
                 "text": tokenizer.decode(output), "finish_reason": "length", "meta_info": {}})
out_dir = work / "completions"
atomic_write_text(out_dir / "completions.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
write_manifest(out_dir, "completions", {"prompts": len(rows)}, ["completions.jsonl"])
PY
extract_request=$(printf '{"target": "%s/models/target", "completions": "%s/completions", "drafter": "%s/models/drafter", "out_dir": "%s/hidden_states", "device": "%s", "dtype": "bfloat16", "require_backend": "%s", "capture_offsets": [-1, 0, 1], "parity_samples": 2}' "$WORK" "$WORK" "$WORK" "$WORK" "$DEVICE" "$REQUIRE")
start=$(date +%s.%N)
echo "$extract_request" | python3 -m specops.extract --run > "$WORK/extract.json"
extract_s=$(python3 -c "import time; print(round(time.time() - $start, 2))")
score_request=$(printf '{"hidden_states": "%s/hidden_states", "completions": "%s/completions", "target": "%s/models/target", "drafter": "%s/models/drafter", "out_dir": "%s/score", "device": "%s", "dtype": "bfloat16"}' "$WORK" "$WORK" "$WORK" "$WORK" "$WORK" "$DEVICE")
echo "$score_request" | python3 -m specops.score --run > "$WORK/score.json"
python3 - "$WORK" "$OUT" "$extract_s" <<'PY'
import json, sys, time
from pathlib import Path
work, out, extract_s = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
import torch
extract = json.loads((work / "extract.json").read_text().splitlines()[-1])
score = json.loads((work / "score.json").read_text().splitlines()[-1])
manifest = json.loads((work / "hidden_states/manifest.json").read_text())
result = {
    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    "torch": torch.__version__,
    "extract_wall_s_including_triton_compile": extract_s,
    "extract": {k: extract.get(k) for k in ("changed", "layer_ids", "records", "tokens", "backend", "parity",
                                             "progress")},
    "manifest_backend": manifest.get("backend"),
    "score": {k: score.get(k) for k in ("tau", "steps", "n_prompts", "verdict")},
}
(out / "stages_on_gpu.json").write_text(json.dumps(result, indent=2))
print(json.dumps(result, indent=2))
PY
