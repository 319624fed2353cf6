#!/usr/bin/env bash
# Prove that a GPU host runs fla's gated delta rule kernel, and how close it is to the torch reference.
#
# Run from the checkout on the GPU host (no network needed):
#   bash benchmarks/fla_env_h200.sh            # result on stdout (last line)
#   OUT=/some/dir bash benchmarks/fla_env_h200.sh   # also written to $OUT/fla_env_h200.json
#
# The host's own python3 provides torch (CUDA) and triton. fla-core, flash-linear-attention and
# transformers arrive as wheels in .whl/, made on a machine with network access by:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#       fla-core==0.6.0 flash-linear-attention==0.6.0 transformers==5.23.0
# They are installed into $SITE (not into the host's Python) and put first on PYTHONPATH.
# The check fails (exit 2, message on stdout) unless the backend is fla-cuda (require_backend fla).
set -euo pipefail

cd "$(dirname "$0")/.."
SITE=${SITE:-/tmp/site}
PYTHON=${PYTHON:-python3}

shopt -s nullglob
wheels=(.whl/*.whl)
if ((${#wheels[@]})); then
    "$PYTHON" -m pip install --quiet --no-index --no-deps --upgrade --target "$SITE" "${wheels[@]}" >&2
else
    echo "fla_env_h200: no wheels in .whl/: using whatever fla/transformers $PYTHON already has" >&2
fi
export PYTHONPATH="$SITE:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv >&2 || true

# Shapes: the small default pair, then Qwen3.5/3.6 Gated DeltaNet layers (16 key heads, 32 or 48
# value heads, head dims 128) at extraction-like sequence lengths, in fp32 and bf16.
request=$(cat <<'JSON'
{
  "require_backend": "fla",
  "gdr_sizes": [
    {"batch": 2, "seq_len": 300, "k_heads": 2, "v_heads": 4, "head_k_dim": 64, "head_v_dim": 64, "dtype": "float32"},
    {"batch": 2, "seq_len": 300, "k_heads": 2, "v_heads": 4, "head_k_dim": 64, "head_v_dim": 64, "dtype": "bfloat16"},
    {"batch": 1, "seq_len": 2048, "k_heads": 16, "v_heads": 48, "head_k_dim": 128, "head_v_dim": 128, "dtype": "float32"},
    {"batch": 1, "seq_len": 2048, "k_heads": 16, "v_heads": 48, "head_k_dim": 128, "head_v_dim": 128, "dtype": "bfloat16"},
    {"batch": 4, "seq_len": 1000, "k_heads": 16, "v_heads": 32, "head_k_dim": 128, "head_v_dim": 128, "dtype": "bfloat16"},
    {"batch": 1, "seq_len": 8192, "k_heads": 16, "v_heads": 48, "head_k_dim": 128, "head_v_dim": 128, "dtype": "bfloat16"}
  ]
}
JSON
)

status=0
result=$(printf '%s' "$request" | "$PYTHON" -m specops.envcheck --run) || status=$?
last=$(printf '%s\n' "$result" | tail -n 1)
printf '%s\n' "$last"
if [[ -n "${OUT:-}" ]]; then
    mkdir -p "$OUT"
    printf '%s\n' "$last" | "$PYTHON" -m json.tool > "$OUT/fla_env_h200.json"
fi
exit "$status"
