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
# stand-in that installs the requested pip from the package index, which is reachable: with the uv
# that make builds (.work/uv) where there is one, else with ensurepip and then pip itself. uv takes
# about 0.2 CPU-s a venv where ensurepip and a pip upgrade take about 5 (nine venvs a sanity run).
# Written every run: the script names this checkout's uv.
seed_pip_bootstrap() {
  local pip_version cache uv
  pip_version="$("$VENV/bin/python" - <<'EOF'
from ansible_test._internal.python_requirements import get_venv_packages


class Python:
    version = "3.12"


print(get_venv_packages(Python())["pip"])
EOF
)"
  cache="$HOME/.ansible/test/cache/get_pip_${pip_version//./_}.py"
  uv="${UV:-$ROOT/.work/uv/bin/uv}"
  mkdir -p "$(dirname "$cache")"
  cat >"$cache.tmp.$$" <<EOF
"""Offline stand-in for get-pip.py: installs the requested pip into this interpreter's environment."""
import os
import subprocess
import sys

UV = "$uv"
# ansible-test runs this script in an environment of its own; uv reads the machine's certificates
# (a TLS proxy's) from SSL_CERT_FILE, as make's uv does, where pip reads its own configuration.
CERTS = "${SSL_CERT_FILE:-}"
# get-pip.py's own switches mean "do not install these"; an installer has no such options.
args = [a for a in sys.argv[1:] if a not in ("--no-setuptools", "--no-wheel")]
if os.access(UV, os.X_OK):
    packages = [a for a in args if not a.startswith("-")]
    env = dict(os.environ, SSL_CERT_FILE=CERTS) if CERTS else None
    sys.exit(subprocess.call([UV, "pip", "install", "--quiet", "--python", sys.executable] + packages, env=env))
# In a child process: ensurepip points PIP_CONFIG_FILE at /dev/null in its own environment, and
# the install below must read the machine's pip configuration (index, certificates).
subprocess.check_call([sys.executable, "-m", "ensurepip", "--upgrade"])
sys.exit(subprocess.call([sys.executable, "-m", "pip", "install"] + args))
EOF
  mv "$cache.tmp.$$" "$cache"
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
