#!/usr/bin/env bash
# What the one-GPU PD proof needs beyond the 0.5.23 kit (results/pd-disaggregation/README.md):
# mooncake-transfer-engine-cuda13 (the image's torch is cu130; moves KV over loopback TCP with
# MC_FORCE_TCP), sglang-router (SGLang's MiniLB lives there), msgpack, and the RDMA libraries the
# mooncake engine links against (Debian 12 packages, unpacked there onto LD_LIBRARY_PATH; no RDMA
# device is opened). Written as .pd-p1 .. .pd-pN, 28 MiB each, carried after the kit's parts:
#   bash lab/pack-pd.sh            here, in the repo root (downloads about 81 MB)
#   bash lab/gpu_pd.sh OUTDIR      there, once every part has been carried (see its --help)
case "${1:-}" in -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/pd"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$tmp/pd" mooncake-transfer-engine-cuda13==0.3.14 sglang-router==0.3.2 msgpack==1.1.2
o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
mkdir -p /tmp/amd64/partial
apt-get $o update -qq
(cd "$tmp/pd" && apt-get $o download -qq libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200)
(cd "$tmp" && tar -cf - pd) | split -b 28M -d - "$tmp/pd.part"
(cd "$tmp" && sha256sum pd.part* > pd.sha256)
rm -rf .pd-p[0-9]
i=1
for part in "$tmp"/pd.part*; do
    mkdir -p .pd-p$i && mv "$part" .pd-p$i/ && cp "$tmp/pd.sha256" .pd-p$i/
    i=$((i + 1))
done
du -sh .pd-p[0-9]
