#!/usr/bin/env bash
# Run `ansible-test sanity` or `ansible-test units` for the specops.drafter collection, offline.
#
# Usage: tests/run-ansible-test.sh sanity|units [extra ansible-test options]
#
# ansible-test runs from the collection root (.../ansible_collections/specops/drafter) with the
# control venv (.venv, Python 3.12) as --local. Files need not be committed: its git source
# provider lists tracked and untracked-but-not-ignored files alike.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
COLLECTION="$ROOT/collections/ansible_collections/specops/drafter"
VENV="${VENV:-$ROOT/.venv}"
PYTHON_VERSION="3.12"

command="${1:-}"
shift || true

if [[ ! -x "$VENV/bin/ansible-test" ]]; then
  echo "ansible-test not found in $VENV: run 'make venv' (installs requirements/test.lock)" >&2
  exit 1
fi
export PATH="$VENV/bin:$PATH"
# ansible-test prefers en_US.UTF-8 and warns otherwise; C.UTF-8 is always present.
export LC_ALL="${LC_ALL:-C.UTF-8}"

# Sanity tests run in per-test venvs that ansible-test creates without pip and then bootstraps
# with a get-pip script from a CI file server that is unreachable offline. Seed its cache with a
# stand-in that bootstraps pip from the standard library (ensurepip) and then lets pip install the
# requested version from the package index, which is reachable.
seed_pip_bootstrap() {
  local pip_version cache
  pip_version="$("$VENV/bin/python" - <<'EOF'
from ansible_test._internal.python_requirements import get_venv_packages


class Python:
    version = "3.12"


print(get_venv_packages(Python())["pip"])
EOF
)"
  cache="$HOME/.ansible/test/cache/get_pip_${pip_version//./_}.py"
  [[ -s "$cache" ]] && return 0
  mkdir -p "$(dirname "$cache")"
  cat >"$cache.tmp" <<'EOF'
"""Offline stand-in for get-pip.py: ensurepip, then pip installs the requested packages."""
import subprocess
import sys

# In a child process: ensurepip points PIP_CONFIG_FILE at /dev/null in its own environment, and
# the install below must read the machine's pip configuration (index, certificates).
subprocess.check_call([sys.executable, "-m", "ensurepip", "--upgrade"])
# get-pip.py's own switches mean "do not install these"; pip install has no such options.
args = [a for a in sys.argv[1:] if a not in ("--no-setuptools", "--no-wheel")]
sys.exit(subprocess.call([sys.executable, "-m", "pip", "install"] + args))
EOF
  mv "$cache.tmp" "$cache"
}

cd "$COLLECTION"
case "$command" in
  sanity)
    seed_pip_bootstrap
    # Every sanity test runs. pslint and shellcheck find no targets (the collection has no
    # PowerShell and no shell scripts) and pass; a shell script added later needs `shellcheck`
    # (a Debian package) on PATH.
    exec ansible-test sanity --local --python "$PYTHON_VERSION" --color no "$@"
    ;;
  units)
    exec ansible-test units --local --python "$PYTHON_VERSION" --color no "$@"
    ;;
  *)
    echo "usage: $0 sanity|units [ansible-test options]" >&2
    exit 2
    ;;
esac
