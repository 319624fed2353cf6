#!/usr/bin/env bash
# One evaluation on the local default (eval.yml from a fresh work directory: demo models, completions,
# window, extraction, score, report), its stages started anew (off: SPECOPS_STAGE_HOST=0) or forked from
# the stage host (cold: no host when the play starts, so its first stage call starts one, as for the
# day's first evaluation on a host; warm: the host the previous run left), the arms taking turns.
# Wall time, and CPU read from /proc/stat (every process counts: the machine must be otherwise idle),
# the stage host included. The hosts live in a runtime directory of this script's own, which it clears.
#   benchmarks/stage_host_local.sh [ROUNDS]   (default 2; a warm-up run first, not counted)
# Prints one JSON line a run; needs `make venv ml-env`.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ROUNDS=${1:-2}
WORK=$ROOT/.work/stage-host-bench
RUNTIME=/tmp/specops-bench-runtime
mkdir -p "$WORK" "$RUNTIME"
chmod 700 "$RUNTIME"
export XDG_RUNTIME_DIR=$RUNTIME

stop_hosts() {  # the hosts this script's runs started, and only those
  pkill -f "specops.stage_host --socket $RUNTIME/" 2>/dev/null || true
  while pgrep -f "specops.stage_host --socket $RUNTIME/" > /dev/null; do sleep 0.2; done
}

run() {  # run ARM N: one evaluation, then its server stopped; prints a JSON line
  local arm=$1 n=$2 enabled=1
  [[ $arm == off ]] && enabled=0
  [[ $arm == warm ]] || stop_hosts
  local dir=$WORK/$arm-$n
  rm -rf "$dir"
  local vars=(-e "specops_work_dir=$dir" -e "sglang_service_port=30078")
  local before after start rc=0
  before=$(head -1 /proc/stat) start=$(date +%s.%N)
  (cd "$ROOT" && SPECOPS_STAGE_HOST=$enabled "$ROOT/.venv/bin/ansible-playbook" playbooks/eval.yml "${vars[@]}" \
     > "$dir.log" 2>&1) || rc=$?
  (cd "$ROOT" && "$ROOT/.venv/bin/ansible-playbook" playbooks/service.yml "${vars[@]}" \
     -e sglang_service_state=stopped -e sglang_service_guard=false >> "$dir.log" 2>&1) || rc=$((rc ? rc : 1))
  after=$(head -1 /proc/stat)
  python3 - "$arm" "$n" "$rc" "$start" "$before" "$after" <<'PY'
import json, os, sys, time
arm, n, rc, start, before, after = sys.argv[1:]
used = sum(int(b) - int(a) for a, b in list(zip(before.split()[1:], after.split()[1:]))[:3])
print(json.dumps({"arm": arm, "run": int(n), "rc": int(rc), "wall_s": round(time.time() - float(start), 1),
                  "cpu_core_s": round(used / os.sysconf("SC_CLK_TCK"), 1)}), flush=True)
PY
}

run off 0 > /dev/null
for n in $(seq "$ROUNDS"); do
  run off "$n"
  run cold "$n"
  run warm "$n"
done
stop_hosts
