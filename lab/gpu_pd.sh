#!/usr/bin/env bash
# The one-GPU PD proof on the GPU machine (SGLang 0.5.23): the kit staged (lab/gpu_setup.sh), then
# the parts of lab/pack-pd.sh carried in back-to-back runs, each run stashing what it carries:
#   runs carrying .pd-p1, .pd-p2 ...:  bash lab/gpu_pd.sh          (stashes; says what is missing)
#   the run that completes the set:    bash lab/gpu_pd.sh OUTDIR [lab/pd_pair.py options]
# Installs the wheels into /tmp/pd-site and the libraries into /tmp/pd-root once, then runs
# lab/pd_pair.py with them on PYTHONPATH and LD_LIBRARY_PATH.
case "${1:-}" in -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;; esac
set -uo pipefail
cd "$(dirname "$0")/.."
source lab/gpu_setup.sh 0.5.23 || exit 1
parts=/tmp/pd-parts
mkdir -p $parts
for f in .pd-p*/pd.*; do [ -f "$f" ] && cp -n "$f" $parts/; done
if [ ! -f /tmp/pd-site/.ok ]; then
    if ! (cd $parts && [ -f pd.sha256 ] && sha256sum -c --quiet pd.sha256 >/dev/null 2>&1); then
        echo "gpu_pd: parts incomplete; stashed: $(ls $parts | tr '\n' ' ')" >&2
        exit 0
    fi
    rm -rf /tmp/pd /tmp/pd-site /tmp/pd-root && mkdir -p /tmp/pd-root
    cat $parts/pd.part* | tar -x -C /tmp || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pd-site /tmp/pd/*.whl || exit 1
    for deb in /tmp/pd/*.deb; do dpkg -x "$deb" /tmp/pd-root; done
    touch /tmp/pd-site/.ok
fi
export PYTHONPATH=/tmp/pd-site:$PYTHONPATH
export LD_LIBRARY_PATH=/tmp/pd-root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
[ $# -gt 0 ] || exit 0
exec python3 -m lab.pd_pair "$@"
