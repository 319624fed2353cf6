#!/usr/bin/env bash
# The controller's CPU for one eval.yml rerun on the local default (the demo's run: `make demo` first,
# so the rerun changes nothing), with the facts eval.yml gathers (min and hardware) against every
# subset: each task of the play carries the host's facts. Rounds alternate the two; prints one line a
# run (CPU of the play and every process it started, as bash's `time` counts it).
#   benchmarks/gather_subset.sh [ROUNDS]    (default 3)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
rounds=${1:-3}
# A copy beside eval.yml (its tasks/ are found relative to it), gathering every subset.
all=playbooks/.eval-gather-all.yml
trap 'rm -f "$all"' EXIT
sed 's/^  gather_subset: \[min, hardware\]$/  gather_subset: [all]/' playbooks/eval.yml > "$all"
grep -q '^  gather_subset: \[all\]$' "$all" || { echo "eval.yml gathers no [min, hardware]: nothing to compare" >&2; exit 1; }
export ANSIBLE_CONFIG=$ROOT/ansible.cfg
for round in $(seq "$rounds"); do
  for book in playbooks/eval.yml "$all"; do
    TIMEFORMAT="round $round $(basename "$book"): wall %R s, CPU %U+%S s"
    time .venv/bin/ansible-playbook "$book" -e "fla_env_python=$ROOT/.venv-ml/bin/python" > /dev/null
  done
done
