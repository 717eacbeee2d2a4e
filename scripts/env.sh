#!/usr/bin/env bash
# Creates (or reuses) the project's environment in .venv/ at the project root.
#
# The heavy part (sglang==0.5.23 and its ~11 GB of dependencies) lives in a base environment cached under
# ${KVREP_CACHE:-~/.cache/sglang-kvrep}/base-<hash of requirements-pins.txt and requirements-native.txt>, built once
# per pin set (with the shared libraries Mooncake's CPU wheel needs, `kvrep_dev.native_libs`) and
# shared by every clone. .venv/ is a small real venv whose site-packages points at the base one through a .pth
# file, with this project installed in editable mode. It also builds, once per clone, the local test models and
# (only on hosts without an NVIDIA driver) the libcuda.so.1 stand-in the CPU SGLang server needs.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null || py=python3
cache="${KVREP_CACHE:-$HOME/.cache/sglang-kvrep}"
key="$( (cat requirements-pins.txt requirements-native.txt; "$py" -c 'import sys; print(sys.version_info[:2])') \
  | sha256sum | cut -c1-16)"
base="$cache/base-$key"
mkdir -p "$cache"

if [ ! -f "$base/.complete" ]; then
  echo "[env] building the base environment $base (first time for these pins: ~5 min, ~11 GB)"
  rm -rf "$base"
  "$py" -m venv "$base"
  "$base/bin/pip" install -q --upgrade pip setuptools wheel
  "$base/bin/pip" install -q -r requirements-pins.txt
  # drop base envs of older pin sets so the disk does not fill up.
  for old in "$cache"/base-*; do
    [ "$old" = "$base" ] || [ ! -d "$old" ] || { echo "[env] removing stale $old"; rm -rf "$old"; }
  done
  touch "$base/.complete"
else
  echo "[env] reusing the base environment $base"
fi

base_sp="$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# the shared libraries Mooncake's CPU wheel links against, next to it (requirements-native.txt): tried on every run
# until they are there, never fatal (without them only --kvrep-transport mooncake cannot load, and its tests fail)
if [ ! -f "$base_sp/kvrep_native_libs/.complete" ]; then
  if PYTHONPATH="$root" "$base/bin/python" -m kvrep_dev.native_libs requirements-native.txt \
      "$base_sp/kvrep_native_libs"; then
    touch "$base_sp/kvrep_native_libs/.complete"
  else
    echo "[env] warning: no native libraries for Mooncake (see above); --kvrep-transport mooncake will not load"
  fi
fi
if [ ! -x .venv/bin/python ] || [ "$(cat .venv/.base 2>/dev/null)" != "$base" ]; then
  rm -rf .venv
  "$py" -m venv .venv
  echo "$base" > .venv/.base
fi
venv_sp="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$base_sp" > "$venv_sp/_kvrep_base_env.pth"
# console scripts of the base env (sglang, pytest, ...) on the venv's PATH
for exe in "$base"/bin/*; do
  name="$(basename "$exe")"
  case "$name" in python*|pip*|activate*|Activate*) continue;; esac
  [ -e ".venv/bin/$name" ] || ln -s "$exe" ".venv/bin/$name"
done
.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "^$" || true
.venv/bin/python -c "import sglang_kvrep, radix_sync" 

# the CPU-only pieces: local models and, on driverless hosts, the libcuda stand-in.
.venv/bin/python -m kvrep_dev.prepare "$root/.cache"
