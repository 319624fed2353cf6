#!/usr/bin/env bash
# eval.yml end to end through ansible-playbook on one GPU host, as a user with one GPU host runs it:
# localhost inventory (inventory/local), torch from the image's own venv (fla_env_system_site_packages:
# the ML environment sees that venv's packages), fla, transformers and the build backend from a
# wheelhouse (fla_env_no_index), the development server standing in for SGLang on CUDA.
#
# PLAYS may name memory_saver-all: memory-saver mode with every tag released (the weights through their
# CPU backup) beside the default plan, which keeps the weights on the GPU where the extraction fits.
# PROMPTS names a prompts file in place of the demo's (fewer prompts: a shorter prefetch on large targets).
#
# For each target (TARGETS: "fixture" = the demo's models built by the play; "big" = a 2.5 B-parameter
# target, 5.1 GB; "14b" = a 14.7 B-parameter target, 29.4 GB, with Qwen3.6-27B's layer shapes and
# vocabulary and half its layers; both built from config by build_target.py and saved to disk once):
# a run in stop mode, a run in memory-saver mode, and a second stop run on the same host (fresh run
# directory, same host cache), which must pay no kernel tuning. Every play gets a fresh run directory,
# so each one takes the window. The summary's `scaling` shows how downtime, the release (or stop), the
# resume (or start), pinning and the copy to the device grow with the weights, and projects them to
# Qwen3.6-27B's 54 GB.
#
# The 14b target takes 29.4 GB of disk (with big's 5.1 GB and the ML environment, ~40 GB of the host's
# 64), is built once (random init on the GPU, save_pretrained; about a minute or two), and in
# memory-saver mode asks the host for its pinned weights and the server's CPU backup, ~65 GB (the
# plan's host_memory says whether they were pinned). A command runs at most 10 minutes: split the
# plays over calls with PLAYS and TARGETS, keeping $WORK.
#
# Run from the checkout on the GPU host, with the wheels in .whl/ (benchmarks/README.md):
#   TARGETS="fixture big 14b" benchmarks/eval_h200.sh
# On a host that keeps $WORK between calls, a later call adds its plays to the same results:
#   PLAYS=memory_saver TARGETS=fixture ...; then PLAYS=stop-again TARGETS="fixture big" ...
# Results: $OUT/eval_h200.json (rewritten after every play), the plays' logs in $OUT/eval_h200.log.
#
# A lease is shorter than all the plays: a play that finished is marked done in $WORK and skipped by a
# later call, and with DEADLINE (epoch seconds) a play whose estimate (ESTIMATE_<target>, seconds,
# start-server included) would end past it is left for the next call, so every call can be the same
# command. PREVIOUS names an earlier record whose plays this run did not repeat: they are kept in the
# summary, each with its own date. Every play's slowest tasks come from ansible's junit callback.
set -uo pipefail
ROOT=$PWD
OUT=${OUT:-$(mktemp -d)}
WORK=${WORK:-/tmp/specops-h200}
WHEELS=${WHEELS:-$ROOT/.whl}
TARGETS=${TARGETS-fixture big 14b}
PORT=${PORT:-31000}
# The plays per target, in order: a mode (stop, memory_saver), or a mode with -again for a second run;
# PLAYS_<target> overrides it for one target.
PLAYS=${PLAYS:-stop memory_saver stop-again}
DEADLINE=${DEADLINE:-}
PREVIOUS=${PREVIOUS:-}
# The served target's drafter is loaded by the server (speculative decoding, as yesterday's record ran)
# only for these targets: the development server verifies without a KV cache, which at 14 B makes the
# prefetch take minutes that say nothing about the window.
SERVE_DRAFTER=${SERVE_DRAFTER:-big}
# The completions' length for the targets built by build_target.py (the fixture keeps the default).
MAX_NEW_TOKENS_14b=${MAX_NEW_TOKENS_14b:-128}
export SERVE_DRAFTER MAX_NEW_TOKENS_14b SCORE_DEVICE_14b=${SCORE_DEVICE_14b:-cuda}
mkdir -p "$WORK/vars" "$WORK/logs" "$WORK/done" "$WORK/junit"
touch "$WORK/plays.jsonl"

python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ansible-site \
  "$WHEELS"/ansible_core-*.whl "$WHEELS"/resolvelib-*.whl "$WHEELS"/cryptography-*.whl \
  "$WHEELS"/cffi-*.whl "$WHEELS"/pycparser-*.whl || exit 1
# The development server's --enable-memory-saver on CUDA releases through torch_memory_saver.
python3 -m pip install -q --no-index --no-deps "$WHEELS"/torch_memory_saver-*.whl || exit 1
# Only the control node's packages: the ML environment is built by the play itself.
export PYTHONPATH=/tmp/ansible-site ANSIBLE_CONFIG=$ROOT/ansible.cfg ANSIBLE_NOCOLOR=1 ANSIBLE_FORCE_COLOR=0
export ANSIBLE_CALLBACKS_ENABLED=ansible.builtin.junit JUNIT_TASK_CLASS=yes

# fits NAME SECONDS: whether a step estimated at SECONDS ends before DEADLINE (always without one)
fits() {
  [ -z "$DEADLINE" ] && return 0
  local left=$((DEADLINE - $(date +%s)))
  [ "$left" -ge "$2" ] && return 0
  echo "== $1 (about $2 s) does not fit in the $left s left before the deadline: left for the next call"
  return 1
}

# vars NAME TARGET MODE: the extra vars of one play, as a file
vars() {
  python3 - "$WORK" "$WHEELS" "$PORT" "$1" "$2" "$3" > "$WORK/vars/$1.json" <<'PY'
import json, os, sys
work, wheels, port, name, target, mode = sys.argv[1:]
v = {
    "specops_work_dir": work, "specops_run_dir": f"{work}/runs/{name}",
    "specops_host_cache_dir": f"{work}/cache",
    "fla_env_venv": f"{work}/ml", "fla_env_python": "python3", "fla_env_system_site_packages": True,
    "fla_env_torch": "torch", "fla_env_fla": "always", "fla_env_find_links": [wheels],
    "fla_env_no_index": True, "fla_env_require_backend": "fla",
    # No lock: the wheelhouse holds only what the image's venv lacks (requirements/ml.lock pins 51).
    "fla_env_requirements_lock": "",
    "sglang_service_port": int(port), "sglang_service_extra_args": ["--device", "cuda"],
    "sglang_service_pid_file": f"{work}/sglang.pid", "sglang_service_log_file": f"{work}/sglang.log",
    "extract_hidden_states_require_backend": "fla",
    "score_drafter_device": "cuda", "specops_gpu_window_mode": mode, "sglang_service_memory_saver": mode == "memory_saver",
}
# memory_saver-all: every tag released, the weights through their CPU backup, beside the default plan
# (the KV cache alone, the weights resident) on the same target.
if name.endswith("-all"):
    v["sglang_service_release"] = "all"
    # The same inputs as the play before it: without this, the extraction cache takes that play's output
    # over and no window is taken.
    v["specops_reuse_extractions"] = False
# memory_saver-rehearsal (#42): scoring inside the window on the freed GPU, the drafter and the reference
# of the real DFlash drafter's shape (build_target.py --real-drafter); the layer offsets, which run after
# the window on the bounded CPU (minutes at this shape, and not what the rehearsal measures), are left out.
if name.endswith("-rehearsal"):
    v.update({"specops_score_placement": "window", "specops_reuse_extractions": False,
              "score_drafter_diagnostics": ["acceptance", "backend", "vocabulary"]})
if os.environ.get("PROMPTS"):
    v["specops_prompts"] = os.environ["PROMPTS"]
if target != "fixture":  # built by build_target.py into $WORK/<target>
    v.update({"specops_demo_models": False, "specops_target_model": f"{work}/{target}/target",
              "specops_drafter": f"{work}/{target}/drafter", "specops_reference_drafter": f"{work}/{target}/drafter"})
    # The local inventory serves the reference drafter: only where asked.
    v["sglang_service_draft_model_path"] = f"{work}/{target}/drafter" if target in os.environ.get("SERVE_DRAFTER", "").split() else ""
    # What these plays measure is the window: the layer offsets' two extra passes (minutes on the CPU at
    # hidden 5120) are left out.
    v["score_drafter_diagnostics"] = ["acceptance", "backend", "vocabulary"]
    if os.environ.get(f"MAX_NEW_TOKENS_{target}"):
        v["specops_max_new_tokens"] = int(os.environ[f"MAX_NEW_TOKENS_{target}"])
# SCORE_DEVICE_<target>=cpu: scoring after the window on the host's CPU (beside a 14 B server whose KV pool
# fills the GPU as SGLang's does, scoring on cuda runs out of memory).
v["score_drafter_device"] = os.environ.get(f"SCORE_DEVICE_{target}", "cuda")
if v["score_drafter_device"] == "cpu":
    v["specops_score_placement"] = "cpu"  # after the window: the window measured is the extraction's alone
if name.endswith("-rehearsal"):  # after SCORE_DEVICE_<target>, which would place scoring after the window
    real = f"{work}/{target}/drafter_real"
    v.update({"specops_drafter": real, "specops_reference_drafter": real, "score_drafter_device": "cuda",
              "specops_score_placement": "window"})
print(json.dumps(v))
PY
}

# play NAME PLAYBOOK VARSFILE [extra -e]: run one play, log it, record its wall time and exit status
play() {
  local name=$1 book=$2 varsfile=$3 start rc
  shift 3
  start=$(date +%s.%N)
  JUNIT_OUTPUT_DIR=$WORK/junit/$name python3 /tmp/ansible-site/bin/ansible-playbook "$ROOT/playbooks/$book" -e "@$varsfile" "$@" \
    > "$WORK/logs/$name.log" 2>&1
  rc=$?
  python3 -c "import json,sys,time; print(json.dumps({'play': sys.argv[1], 'playbook': sys.argv[2], 'rc': int(sys.argv[3]),
    'wall_s': round(time.time() - float(sys.argv[4]), 1)}))" "$name" "$book" "$rc" "$start" >> "$WORK/plays.jsonl"
  summarize
  [ $rc -ne 0 ] || touch "$WORK/done/$name"
  return $rc
}

stop_server() {  # the next play starts the server with other options (model, memory saver)
  play "$1-stop-server" service.yml "$WORK/vars/$1.json" -e sglang_service_state=stopped \
    -e sglang_service_guard=false
}

summarize() {
  python3 - "$WORK" "$OUT" "$ROOT" "$PREVIOUS" <<'PY'
import json, subprocess, sys, time
import xml.etree.ElementTree as ET
from pathlib import Path
work, out = Path(sys.argv[1]), Path(sys.argv[2])
previous = json.loads(Path(sys.argv[4]).read_text()) if sys.argv[4] else None
sys.path.insert(0, str(Path(sys.argv[3]) / "benchmarks"))
from window_scaling import scaling
plays = [json.loads(line) for line in (work / "plays.jsonl").read_text().splitlines() if line.strip()]
for play in plays:
    report = work / "runs" / play["play"] / "score" / "report.json"
    if play["playbook"] == "eval.yml" and report.is_file():
        data = json.loads(report.read_text())
        play["window"] = data.get("window")
        play["tau"] = data["overall"]["tau"]
        play["hidden_state_backend"] = (data.get("run") or {}).get("hidden_state_backend")
    # The client that kept requests in flight through a memory-saver window, and the server's pid.
    for key, name in (("client", "loadgen.json"), ("pids", "pids.json"), ("sequential_check", "sequential.json")):
        path = work / "logs" / f"{play['play']}.{name}"
        text = path.read_text().strip() if path.is_file() else ""
        if text:
            # One JSON document (the sequential check's, indented), or a log whose last line is one.
            try:
                play[key] = json.loads(text)
            except ValueError:
                play[key] = json.loads(text.splitlines()[-1])
    # Where the play's time went: its eight slowest tasks (ansible's junit callback).
    tasks = [(float(case.get("time") or 0), case.get("name", "")) for xml in (work / "junit" / play["play"]).glob("*.xml")
             for case in ET.parse(xml).iter("testcase")]
    if tasks:
        play["slowest_tasks"] = [{"s": round(t, 1), "task": n} for t, n in sorted(tasks, reverse=True)[:8]]
    play.setdefault("date", time.strftime("%Y-%m-%d"))
if previous:
    names = {p["play"] for p in plays}
    kept = [dict(p, date=p.get("date") or previous["date"][:10]) for p in previous["plays"] if p["play"] not in names]
    plays = kept + plays
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip()
built = {t: json.loads((work / t / "built.json").read_text()) for t in ("big", "14b") if (work / t / "built.json").is_file()}
# Targets built on an earlier host: their plays are kept from PREVIOUS, so are their weights.
for t, b in ((previous or {}).get("targets") or {}).items():
    built.setdefault(t, b)
weights = {t: b["weights_bytes"] for t, b in built.items()}
fixture = sum(f.stat().st_size for f in (work / "models" / "target").glob("*.safetensors"))
if fixture:
    weights["fixture"] = fixture
result = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": smi,
          "big_target": built.get("big"), "targets": built, "plays": plays,
          "scaling": scaling(plays, weights)}
(out / "eval_h200.json").write_text(json.dumps(result, indent=1))
with open(out / "eval_h200.log", "w") as log:
    for path in sorted((work / "logs").glob("*.log"), key=lambda p: p.stat().st_mtime):
        log.write(f"===== {path.name}\n" + "".join(path.read_text().splitlines(True)[-150:]))
PY
}

for target in $TARGETS; do
  vars "$target-stop" "$target" stop
  estimate_var=ESTIMATE_$target
  estimate=${!estimate_var:-400}
  size=$([ "$target" = big ] && echo 2b || echo "$target")
  if [ "$target" != fixture ] && [ ! -f "$WORK/$target/built.json" ]; then
    fits "build $target" $((estimate / 2)) || break
    # The ML environment and the fixture tokenizer, when no fixture run came first on this host.
    [ -x "$WORK/ml/bin/python" ] || play "$target-ml-env" ml_env.yml "$WORK/vars/$target-stop.json" || exit 1
    [ -d "$WORK/models/target" ] || "$WORK/ml/bin/python" -m specops.fixtures --out "$WORK/models" \
      --no-reference-training --prompts "$ROOT/prompts/coding.jsonl" > "$WORK/logs/build-fixtures.log" 2>&1 || { summarize; exit 1; }
    "$WORK/ml/bin/python" "$ROOT/benchmarks/build_target.py" --size "$size" --tokenizer "$WORK/models/target" \
      --out "$WORK/$target" > "$WORK/logs/build-$target.log" 2>&1 || { summarize; exit 1; }
  fi
  # A rehearsal scores with a drafter of the real shape: built once beside the target.
  plays_var=PLAYS_$target
  case " ${!plays_var:-$PLAYS} " in *-rehearsal*)
    [ -f "$WORK/$target/drafter_real/config.json" ] || PYTHONPATH=$ROOT/src "$WORK/ml/bin/python" \
      "$ROOT/benchmarks/build_target.py" --size "$size" --tokenizer "$WORK/models/target" --out "$WORK/$target" \
      --real-drafter >> "$WORK/logs/build-$target.log" 2>&1 || { summarize; exit 1; } ;;
  esac
  plays_var=PLAYS_$target
  for name in ${!plays_var:-$PLAYS}; do
    mode=${name%-again}
    mode=${mode%-all}
    mode=${mode%-rehearsal}
    [ ! -f "$WORK/done/$target-$name" ] || continue
    fits "$target-$name" "$estimate" || break 2
    vars "$target-$name" "$target" "$mode"
    # A server of another target or other options may be running: the play starts its own (the same
    # target in the same mode keeps its server: a release choice is not a server option).
    [ ! -f "$WORK/served" ] || [ "$(cat "$WORK/served")" = "$target-$mode" ] || stop_server "$target-$name"
    echo "$target-$mode" > "$WORK/served"
    if [ "$mode" = memory_saver ]; then
      # The server starts before the play: on a fresh host the play's environment part (the ML
      # environment, the demo models) runs first, in a run directory of its own.
      if [ ! -x "$WORK/ml/bin/python" ] || { [ "$target" = fixture ] && [ ! -f "$WORK/models/fixtures.json" ]; }; then
        vars "$target-env" "$target" "$mode"
        play "$target-env" eval.yml "$WORK/vars/$target-env.json" --tags environment || exit 1
      fi
      # A client keeps short, long and streaming requests in flight through the window: none may be
      # lost or cut short, and the server's process must be the same after it.
      play "$target-$name-start-server" service.yml "$WORK/vars/$target-$name.json" -e sglang_service_state=started || exit 1
      pid_before=$(cat "$WORK/sglang.pid" 2>/dev/null | cut -d' ' -f1)
      rm -f "$WORK/loadgen.stop"
      PYTHONPATH=$ROOT/src python3 -m specops.loadgen --url "http://127.0.0.1:$PORT" --kinds short,long,stream \
        --concurrency 4 --long-max-new-tokens 64 --timeout 600 --max-seconds 900 --stop-file "$WORK/loadgen.stop" \
        --out "$WORK/logs/$target-$name.requests.jsonl" > "$WORK/logs/$target-$name.loadgen.json" 2>&1 &
      client=$!
      play "$target-$name" eval.yml "$WORK/vars/$target-$name.json"
      rc=$?
      touch "$WORK/loadgen.stop"
      wait $client
      # The rehearsal's tau against the sequential walk on the same hidden states.
      case "$name" in *-rehearsal)
        PYTHONPATH=$ROOT/src "$WORK/ml/bin/python" "$ROOT/benchmarks/score_sequential_check.py" \
          --run "$WORK/runs/$target-$name" --target "$WORK/$target/target" --drafter "$WORK/$target/drafter_real" \
          --out "$WORK/logs/$target-$name.sequential.json" > "$WORK/logs/$target-$name.sequential.log" 2>&1 ;;
      esac
      pid_after=$(cat "$WORK/sglang.pid" 2>/dev/null | cut -d' ' -f1)
      echo "{\"before\": \"$pid_before\", \"after\": \"$pid_after\"}" > "$WORK/logs/$target-$name.pids.json"
      summarize
      [ $rc -eq 0 ] || exit 1
    else
      play "$target-$name" eval.yml "$WORK/vars/$target-$name.json" || exit 1
    fi
  done
done
summarize
