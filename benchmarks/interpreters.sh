#!/usr/bin/env bash
# The CPU the same work takes on each Python this machine has: the distribution's build (PGO and LTO)
# against pyenv's from-source builds (neither, and a shared libpython). Three kinds of work the suite
# does thousands of times: a pure-Python loop, one ansible module (AnsiballZ, ansible.builtin.stat)
# and importing torch with transformers' qwen3_5 modeling (every stage process and development server).
#   benchmarks/interpreters.sh [RUNS]   (one line per interpreter and kind: the median CPU-s of RUNS runs)
# The ML environments for the import are built here from requirements/ml.lock (uv, torch from pip's
# wheelhouse); `make venv` must have run (uv, ansible-core).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
RUNS=${1:-5}
UV=$ROOT/.work/uv/bin/uv
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

cpu() {  # median user+sys CPU seconds of RUNS runs of a command
  for _ in $(seq "$RUNS"); do
    /usr/bin/time -f "%U %S" -o "$tmp/time" "$@" > /dev/null 2>&1 < /dev/null
    awk '{print $1 + $2}' "$tmp/time"
  done | sort -n | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'
}

cat > "$tmp/loop.py" <<'EOF'
total = 0
for i in range(10_000_000):
    total += i
EOF
# One AnsiballZ payload of ansible.builtin.stat, kept from a run of the control venv's ansible.
printf -- '- hosts: localhost\n  gather_facts: false\n  tasks:\n    - ansible.builtin.stat: {path: /tmp}\n' \
  > "$tmp/play.yml"
ANSIBLE_KEEP_REMOTE_FILES=1 ANSIBLE_REMOTE_TMP=$tmp/remote "$ROOT/.venv/bin/ansible-playbook" -i localhost, \
  -c local -e "ansible_python_interpreter=$ROOT/.venv/bin/python" "$tmp/play.yml" > /dev/null
module=$(ls "$tmp"/remote/*/AnsiballZ_stat.py)

for python in /usr/bin/python3.11 "$HOME"/.pyenv/versions/3.11*/bin/python3.11 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
  [[ -x $python ]] || continue
  echo "$python ($("$python" -c 'import platform; print(platform.python_version())')): loop $(cpu "$python" "$tmp/loop.py") CPU-s," \
    "ansible module $(cpu "$python" "$module") CPU-s"
  case $python in *3.11)
    venv=$tmp/ml-$(basename "$(dirname "$(dirname "$python")")")
    "$UV" venv -q --python "$python" "$venv"
    # Compiled once, as the environments of make and fla_env are.
    "$UV" pip install -q --python "$venv/bin/python" --require-hashes --no-deps --compile-bytecode \
      -r "$ROOT/requirements/ml.lock"
    "$UV" pip install -q --python "$venv/bin/python" --no-deps --compile-bytecode \
      $(for dir in ${PIP_FIND_LINKS:-}; do echo "--find-links $dir"; done) \
      "$(sed -n 's/^fla_env_torch: *//p' "$ROOT/inventory/local/group_vars/gpu_hosts.yml")"
    echo "  import torch + transformers qwen3_5 modeling: $(cpu "$venv/bin/python" -c \
      'import torch, transformers; from transformers.models.qwen3_5 import modeling_qwen3_5') CPU-s"
  esac
done
