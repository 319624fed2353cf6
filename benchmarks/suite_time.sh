#!/usr/bin/env bash
# What `make test` (through .ci/run) and `make demo` cost on this machine from a fresh clone: wall time,
# and how busy the cores were meanwhile (/proc/stat before and after), so a slow run can be told apart
# from a machine that was waiting. Optionally the CPU of one eval.yml run on the local default, every
# process it started counted (servers included), through a cpuacct cgroup (root, cgroup v1).
#
#   benchmarks/suite_time.sh [test|demo|readme|eval]...      (default: test demo)
#   (readme: make demo, make demo-stop, then bash .ci/run, in one clone)
#
# FRESH_CACHES=1 moves uv's and pip's caches and ansible-test's environments aside first, as on a clean
# CI machine (they are put back at the end). Results: one JSON line per step on stdout and in
# $OUT (default benchmarks/suite_time.jsonl), each with the date, the commit and the machine.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/benchmarks/suite_time.jsonl}
STEPS=${*:-test demo}
COMMIT=$(git -C "$ROOT" rev-parse --short HEAD)
MACHINE="$(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)"

aside=""
if [ "${FRESH_CACHES:-0}" = 1 ]; then
  aside=$(mktemp -d)
  for cache in "$HOME/.cache/uv" "$HOME/.cache/pip" "$HOME/.ansible/test"; do
    [ ! -e "$cache" ] || mv "$cache" "$aside/$(echo "$cache" | tr / _)"
  done
fi
restore() {
  [ -n "$aside" ] || return 0
  for saved in "$aside"/*; do
    [ -e "$saved" ] || continue
    original=$(basename "$saved" | tr _ /)
    rm -rf "$original" && mv "$saved" "$original"
  done
}
trap restore EXIT

cpu_line() { head -1 /proc/stat; }

# record STEP WALL_S STAT_BEFORE STAT_AFTER RC [EXTRA_JSON]
record() {
  python3 - "$@" <<'PY' | tee -a "$OUT"
import json, sys, datetime, os
step, wall, before, after, rc = sys.argv[1:6]
extra = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
fields = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
delta = dict(zip(fields, (int(b) - int(a) for a, b in zip(before.split()[1:], after.split()[1:]))))
total = sum(delta.values()) or 1
hz = os.sysconf("SC_CLK_TCK")
print(json.dumps({
    "step": step, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "commit": os.environ["COMMIT"], "machine": os.environ["MACHINE"], "rc": int(rc),
    "wall_s": round(float(wall)), "cpu_busy_share": round((delta["user"] + delta["nice"] + delta["system"]) / total, 3),
    "cpu_used_core_s": round((delta["user"] + delta["nice"] + delta["system"]) / hz),
    "iowait_share": round(delta["iowait"] / total, 3), **extra,
}))
PY
}
export COMMIT MACHINE

fresh_clone() {
  local dir
  dir=$(mktemp -d /tmp/specops-suite-time.XXXXXX)
  git clone -q "$ROOT" "$dir/specops"
  echo "$dir/specops"
}

for step in $STEPS; do
  case $step in
    test | demo | readme)
      # readme: the README's two commands in order in one clone, as a user on a fresh machine runs them.
      clone=$(fresh_clone)
      before=$(cpu_line) start=$(date +%s.%N)
      rc=0
      case $step in
        test) (cd "$clone" && bash .ci/run) > "$clone.log" 2>&1 || rc=$? ;;
        demo) (cd "$clone" && make demo && make demo-stop) > "$clone.log" 2>&1 || rc=$? ;;
        readme) (cd "$clone" && make demo && make demo-stop && bash .ci/run) > "$clone.log" 2>&1 || rc=$? ;;
      esac
      record "$step" "$(echo "$(date +%s.%N) - $start" | bc)" "$before" "$(cpu_line)" "$rc" \
        "{\"log\": \"$clone.log\"}"
      ;;
    eval)
      # One eval.yml from scratch, then the same again (nothing to do), on the checkout's environments.
      group=/sys/fs/cgroup/cpuacct/specops-suite-time
      mkdir -p "$group"
      work=$(mktemp -d)
      port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
      for run in first again; do
        echo 0 > "$group/cpuacct.usage"
        before=$(cpu_line) start=$(date +%s.%N)
        rc=0
        (echo $BASHPID > "$group/tasks"; cd "$ROOT" && ANSIBLE_CONFIG=$ROOT/ansible.cfg PYTHONPATH=$ROOT/src \
          .venv/bin/ansible-playbook playbooks/eval.yml -e "{\"specops_work_dir\": \"$work\",
          \"sglang_service_port\": $port, \"sglang_service_pid_file\": \"$work/sglang.pid\",
          \"sglang_service_log_file\": \"$work/sglang.log\", \"sglang_service_ready_delay\": 1}") \
          > "$work/$run.log" 2>&1 || rc=$?
        used=$(python3 -c "print(round($(cat "$group/cpuacct.usage") / 1e9, 1))")
        record "eval-$run" "$(echo "$(date +%s.%N) - $start" | bc)" "$before" "$(cpu_line)" "$rc" \
          "{\"eval_cpu_s\": $used}"
      done
      (cd "$ROOT" && ANSIBLE_CONFIG=$ROOT/ansible.cfg .venv/bin/ansible-playbook playbooks/service.yml \
        -e "{\"specops_work_dir\": \"$work\", \"sglang_service_port\": $port, \"sglang_service_pid_file\": \"$work/sglang.pid\",
        \"sglang_service_state\": \"stopped\", \"sglang_service_guard\": false}") > "$work/stop.log" 2>&1 || true
      ;;
    *) echo "unknown step $step (test, demo, readme, eval)" >&2; exit 2 ;;
  esac
done
