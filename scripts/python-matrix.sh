#!/usr/bin/env bash
# The Python matrix: every Python that pyproject's requires-python admits, besides the one the
# README's test command runs (python3, 3.11 here; the image runs 3.13), gets a venv of its own and runs the
# part of the suite where interpreters differ: the ttrpc server and its handler tasks, the NRI
# multiplexer, the simulator and its runtime restarts, systemd over D-Bus, the healer, the daemon as
# a process (and the fault suite, which drives it through the simulator's runtime quirks), the config and log formats, the DRA front door (gRPC aio, the API client over httpx2,
# the simulator's CDI injection), the one HTTP layer on the loop's callbacks (the status socket's too).
#
# Each minor version is taken from pyenv (the newest patch release installed), else from pythonX.Y
# on PATH. Under CI=true a missing interpreter fails the run; elsewhere it is skipped, said once.
# Usage: scripts/python-matrix.sh [MINOR ...]   (default: 3.10 3.12 3.13)
set -euo pipefail
cd "$(dirname "$0")/.."

versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(3.10 3.12 3.13)
tests=(
  tests/ttrpc
  tests/test_mux.py
  tests/test_nri_end_to_end.py
  tests/test_mixedcpu_end_to_end.py
  tests/test_mixedcpu_numa_end_to_end.py
  tests/test_nri_routes.py
  tests/test_systemd.py
  tests/test_systemd_bus.py
  tests/test_heal.py
  tests/faults
  tests/test_daemon.py
  tests/test_config.py
  tests/test_logs.py
  tests/test_cli.py
  tests/test_enable_nri.py
  tests/dra
  tests/test_simulator_cdi.py
  tests/test_httpserve.py
  tests/test_status_server.py
)

find_python() {
  local minor=$1 root candidate
  root=$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")
  for candidate in $(ls -d "$root/versions/$minor".* 2>/dev/null | sort -V -r); do
    if [ -x "$candidate/bin/python" ]; then
      echo "$candidate/bin/python"
      return 0
    fi
  done
  command -v "python$minor"
}

# Each Python's test dependencies come from a wheelhouse cached outside the clone, keyed by the
# Python, pyproject.toml and the ISO week (so new releases come in weekly), made from PyPI with pip
# download (which checks each file against the index's sha256) and checked against its recorded
# SHA256SUMS before each use. A venv then installs in ~19 s instead of 50-75 s (measured, 2 loaded
# cores). A wheelhouse that fails its check, or an install from it that fails, is made again.
wheel_cache="${XDG_CACHE_HOME:-$HOME/.cache}/mixed-cpu-nri-plugin/wheels"
install_test_deps() {  # install_test_deps VENV MINOR
  local venv=$1 minor=$2 key house
  key="py$minor-$(sha256sum <pyproject.toml | cut -c1-16)-$(date -u +%G-W%V)"
  house="$wheel_cache/$key"
  if [ -f "$house/SHA256SUMS" ] && (cd "$house" && sha256sum -c --quiet --strict SHA256SUMS >/dev/null 2>&1) &&
    "$venv/bin/pip" install -q --no-index --find-links "$house" -e '.[test]'; then
    return 0
  fi
  echo "note: making the Python $minor wheelhouse $house" >&2
  rm -rf "$wheel_cache/py$minor-"* && mkdir -p "$house.partial"
  # The build backend's requirements too: the editable install builds the project offline.
  "$venv/bin/pip" download -q -d "$house.partial" '.[test]' 'setuptools>=68' wheel
  rm -f "$house.partial"/mixed_cpu_nri_plugin-*
  (cd "$house.partial" && sha256sum -- * >SHA256SUMS)
  mv "$house.partial" "$house"
  "$venv/bin/pip" install -q --no-index --find-links "$house" -e '.[test]'
}

failed=()
for minor in "${versions[@]}"; do
  if ! python=$(find_python "$minor"); then
    if [ "${CI:-}" = true ]; then
      echo "error: no Python $minor (pyenv or python$minor on PATH): install it, or change requires-python" >&2
      failed+=("$minor")
    else
      echo "note: no Python $minor here: its part of the matrix is skipped" >&2
    fi
    continue
  fi
  venv=".venvs/$minor"
  echo "== Python $minor: $("$python" --version 2>&1) ($python)"
  rm -rf "$venv" && mkdir -p .venvs
  "$python" -m venv "$venv"
  install_test_deps "$venv" "$minor"
  if ! "$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}"; then
    failed+=("$minor")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "error: the Python matrix failed on: ${failed[*]}" >&2
  exit 1
fi
