#!/usr/bin/env bash
# One device lease's worth of H200 measurements, as the same command on every call: each call goes on
# where the last stopped (eval_h200.sh marks the plays it finished in $WORK, which a warm machine keeps)
# and stops starting work that would not end inside the call's 10 minutes.
#   1. eval_h200.sh: the fixture in stop mode (its memory-saver window was measured earlier the same
#      day, kept from PREVIOUS), then the 14 B and the 2.5 B targets in both modes;
#   2. then, with the time left, scoring at the real drafter's shape (score_real_h200.py).
# Results in $OUT: eval_h200.json, eval_h200.log, score_real_h200.json.
set -uo pipefail
ROOT=$PWD
START=$(date +%s)
CALL_S=${CALL_S:-575}
export OUT=${OUT:-$(mktemp -d)} WORK=${WORK:-/tmp/specops-h200}
export DEADLINE=$((START + CALL_S))
export TARGETS=${TARGETS-fixture 14b big} PLAYS=${PLAYS:-stop memory_saver} PLAYS_fixture=${PLAYS_fixture:-stop}
# Seconds a play takes, start-server included for the memory saver (the first fixture play also builds
# the ML environment and the demo models; a build takes half a play's estimate).
export ESTIMATE_fixture=${ESTIMATE_fixture:-330} ESTIMATE_14b=${ESTIMATE_14b:-480} ESTIMATE_big=${ESTIMATE_big:-420}
export PREVIOUS=${PREVIOUS:-$ROOT/benchmarks/eval_h200.json}
mkdir -p "$WORK"
bash "$ROOT/benchmarks/eval_h200.sh"
echo "== eval_h200.sh: rc $? after $(($(date +%s) - START)) s"
[ ! -f "$WORK/score_real_h200.json" ] || cp "$WORK/score_real_h200.json" "$OUT/"
left=$((DEADLINE - $(date +%s)))
if [ ! -f "$WORK/score_real_h200.done" ] && [ "$left" -ge "${ESTIMATE_score:-240}" ]; then
  PYTHONPATH=$ROOT/src python3 "$ROOT/benchmarks/score_real_h200.py" --sequences 256 --deadline 200 \
    --out "$WORK/score_real_h200.json" && touch "$WORK/score_real_h200.done"
  cp "$WORK/score_real_h200.json" "$OUT/" 2>/dev/null
fi
nvidia-smi --query-gpu=memory.used --format=csv,noheader
df -h "$WORK" | tail -1
ls "$WORK/done"
# The stage hosts of this lease (plugins/module_utils/stages/stage_host.py): which environments had one, and
# whether any failed to start (a <socket>.failed file) or refused a call.
for log in "${XDG_RUNTIME_DIR:-/tmp}/specops-stage-host-$(id -u)"/*.log; do
  [ -f "$log" ] && { echo "== stage host log $log"; tail -5 "$log"; }
done
ls "${XDG_RUNTIME_DIR:-/tmp}/specops-stage-host-$(id -u)"/*.failed 2>/dev/null && echo "(a stage host failed to start)"
