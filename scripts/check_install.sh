#!/usr/bin/env bash
# Test of record: `pip install .` into an environment that already has SGLang must change no
# installed package (no downgrade of torch, transformers, ... to another release's pins).
#   usage: bash scripts/check_install.sh SGLANG_VERSION [WORKDIR]
# Makes WORKDIR/venv-SGLANG_VERSION (default /tmp/dflash-install), installs sglang==VERSION there,
# then this checkout, and prints the `pip freeze` diff; exits 1 if anything but sglang-dflash changed.
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,6p' "$0"; exit 0 ;; "") sed -n '2,6p' "$0" >&2; exit 2 ;; esac
version=$1
work=${2:-/tmp/dflash-install}
here=$(cd "$(dirname "$0")/.." && pwd)
venv=$work/venv-$version
mkdir -p "$work"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "sglang==$version"
"$venv/bin/python" -m pip freeze | sort > "$work/before-$version.txt"
start=$(date +%s)
"$venv/bin/python" -m pip install -q "$here"
echo "sglang $version: pip install . took $(( $(date +%s) - start )) s"
"$venv/bin/python" -m pip freeze | sort > "$work/after-$version.txt"
changes=$(diff "$work/before-$version.txt" "$work/after-$version.txt" | grep '^[<>]' | grep -v 'sglang-dflash' || true)
diff "$work/before-$version.txt" "$work/after-$version.txt" || true
if [ -n "$changes" ]; then
    echo "FAIL: installing sglang-dflash changed other packages"; exit 1
fi
echo "OK: only sglang-dflash was added"
