#!/usr/bin/env bash
# The controller's CPU while a task runs, at ansible's default internal_poll_interval (0.001 s) and at
# the 0.01 s of ansible.cfg: one play whose only task is `sleep 60`, on localhost.
#   benchmarks/poll_interval.sh    (prints one line per interval: wall and CPU seconds)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
printf -- '- hosts: localhost\n  gather_facts: false\n  tasks:\n    - ansible.builtin.command: sleep 60\n' > "$tmp/play.yml"
for interval in 0.001 0.01; do
  printf '[defaults]\ninternal_poll_interval = %s\n' "$interval" > "$tmp/ansible.cfg"
  TIMEFORMAT="internal_poll_interval=$interval wall %R s, CPU %U+%S s"
  time ANSIBLE_CONFIG=$tmp/ansible.cfg "$ROOT/.venv/bin/ansible-playbook" -i localhost, -c local \
    -e "ansible_python_interpreter=$ROOT/.venv/bin/python" "$tmp/play.yml" > /dev/null
done
