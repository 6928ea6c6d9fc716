#!/usr/bin/env bash
# Re-pack the GPU kit and the SmolLM2 GGUF into carry folders small enough to travel next to a
# tree that holds the shipped draft (~24 MB): a run carries at most 64 MiB in all.
#   here, once:  ../shared/devkit/build-gpu-kit.sh $PWD/.devkit && ../shared/devkit/pack-smollm2.sh
#                bash lab/pack_carry.sh            -> .carry1 .. .carry5 (each ~27-33 MB)
#   GPU runs:    carry .carry1, then .carry2, ... back to back; every run stashes what it carries
#                (lab/gpu_setup.sh), and the kit / the model assemble once all their parts are there.
case "${1:-}" in -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")/.."
for f in .devkit/kit_core.tar.xz .devkit-m1/gguf.part00 .devkit-m2/gguf.part01 .devkit-m2/gguf_to_hf.py; do
    [ -f "$f" ] || { echo "pack_carry: $f is missing (see the header)" >&2; exit 1; }
done
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
split -n 2 -d .devkit/kit_core.tar.xz "$tmp/kit.part"
cat .devkit-m1/gguf.part00 .devkit-m2/gguf.part01 > "$tmp/model.gguf"
split -n 3 -d "$tmp/model.gguf" "$tmp/gguf.part" && rm "$tmp/model.gguf"
(cd "$tmp" && sha256sum kit.part* gguf.part* > manifest.sha256)
rm -rf .carry[0-9]
i=1
for part in kit.part00 kit.part01 gguf.part00 gguf.part01 gguf.part02; do
    mkdir -p .carry$i && mv "$tmp/$part" .carry$i/ && cp "$tmp/manifest.sha256" .carry$i/
    i=$((i + 1))
done
cp .devkit-m2/gguf_to_hf.py .carry5/
grep -qx '/.carry\[0-9\]/' .git/info/exclude || echo '/.carry[0-9]/' >> .git/info/exclude
du -sh .carry[0-9]
