#!/usr/bin/env bash
# One evaluation on the local default (eval.yml from a fresh work directory: demo models, completions,
# window, extraction, score, report), with the ML environment and the modules on pyenv's from-source
# Pythons (before) or on the distribution's (after), the two alternating, CPU read from /proc/stat.
# The machine must be otherwise idle: every process counts.
#   benchmarks/eval_interpreters.sh [PAIRS]   (default 2; a warm-up run of each first, not counted)
# Prints one JSON line a run; needs `make venv ml-env` (the after arm is the checkout's .venv-ml).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PAIRS=${1:-2}
WORK=$ROOT/.work/eval-interpreters
UV=$ROOT/.work/uv/bin/uv
PYENV_ML=$(ls -d "$HOME"/.pyenv/versions/3.11*/bin/python3.11 | head -1)
mkdir -p "$WORK"

# The before arm's ML environment: the same locks, on pyenv's Python 3.11; fla_env adds specops.
if [[ ! -x $WORK/ml-pyenv/bin/python ]]; then
  "$UV" venv -q --seed --python "$PYENV_ML" "$WORK/ml-pyenv"  # --seed: pip, which fla_env runs
  "$UV" pip install -q --python "$WORK/ml-pyenv/bin/python" --require-hashes --no-deps --compile-bytecode \
    -r "$ROOT/requirements/ml.lock"
  "$UV" pip install -q --python "$WORK/ml-pyenv/bin/python" --no-deps --compile-bytecode \
    $(for dir in ${PIP_FIND_LINKS:-}; do echo "--find-links $dir"; done) \
    "$(sed -n 's/^fla_env_torch: *//p' "$ROOT/inventory/local/group_vars/gpu_hosts.yml")"
fi

run() {  # run ARM N: one evaluation, then its server stopped; prints a JSON line
  local arm=$1 n=$2 venv python_ml modules
  case $arm in
    before) venv=$WORK/ml-pyenv python_ml=$PYENV_ML modules=$ROOT/.venv/bin/python ;;
    after) venv=$ROOT/.venv-ml python_ml=$(readlink -f "$ROOT/.venv-ml/bin/python") modules=/usr/bin/python3 ;;
  esac
  local dir=$WORK/$arm-$n
  rm -rf "$dir"
  local vars=(-e "specops_work_dir=$dir" -e "fla_env_venv=$venv" -e "fla_env_python=$python_ml"
              -e "ansible_python_interpreter=$modules" -e "sglang_service_port=30077")
  local before after start rc=0
  before=$(head -1 /proc/stat) start=$(date +%s.%N)
  (cd "$ROOT" && "$ROOT/.venv/bin/ansible-playbook" playbooks/eval.yml "${vars[@]}" > "$dir.log" 2>&1) || rc=$?
  (cd "$ROOT" && "$ROOT/.venv/bin/ansible-playbook" playbooks/service.yml "${vars[@]}" \
     -e sglang_service_state=stopped -e sglang_service_guard=false >> "$dir.log" 2>&1) || rc=$((rc ? rc : 1))
  after=$(head -1 /proc/stat)
  python3 - "$arm" "$n" "$rc" "$start" "$before" "$after" <<'PY'
import json, os, sys, time
arm, n, rc, start, before, after = sys.argv[1:]
used = sum(int(b) - int(a) for a, b in list(zip(before.split()[1:], after.split()[1:]))[:3])
print(json.dumps({"arm": arm, "run": int(n), "rc": int(rc), "wall_s": round(time.time() - float(start), 1),
                  "cpu_core_s": round(used / os.sysconf("SC_CLK_TCK"), 1)}))
PY
}

run before 0 > /dev/null
run after 0 > /dev/null
for n in $(seq "$PAIRS"); do
  run before "$n"
  run after "$n"
done
