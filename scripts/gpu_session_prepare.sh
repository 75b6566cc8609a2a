#!/usr/bin/env bash
# On the host, before scripts/gpu_session.sh runs on a GPU machine without network: wheels it lacks into .whl/
# and a trimmed Megatron-LM checkout into .mlm/ (both git-ignored; pass them in the device run's carry).
#   bash scripts/gpu_session_prepare.sh /path/to/Megatron-LM [python-version, default 3.12]
set -euo pipefail
cd "$(dirname "$0")/.."
mlm=${1:?usage: gpu_session_prepare.sh /path/to/Megatron-LM [python-version]}
pyver=${2:-3.12}
exclude="$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")"
for folder in /.whl/ /.mlm/; do grep -qx "$folder" "$exclude" 2>/dev/null || echo "$folder" >> "$exclude"; done
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64 any; do platforms+=(--platform "$p"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    "${platforms[@]}" -d .whl megatron-core==0.16.1 liger-kernel pydantic pydantic-core annotated-types \
    typing-inspection six
# the VLM benchmark's data pipeline and its transformers peer (scripts/gpu_session.sh vlm)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    "${platforms[@]}" -d .whl transformers==4.57.6 tokenizers==0.22.2 safetensors huggingface-hub==0.36.2 pillow \
    regex pyyaml tqdm filelock fsspec requests urllib3 certifi idna charset-normalizer hf-xet packaging
rm -rf .mlm && mkdir -p .mlm/megatron
cp "$mlm"/{pretrain_gpt.py,gpt_builders.py,model_provider.py} .mlm/
for part in core training legacy post_training rl; do
    [ -d "$mlm/megatron/$part" ] && cp -r "$mlm/megatron/$part" .mlm/megatron/
done
cp "$mlm"/megatron/__init__.py .mlm/megatron/ 2>/dev/null || true
find .mlm -name '__pycache__' -type d -prune -exec rm -rf {} +
find .mlm -name '*.so' -delete
du -sh .whl .mlm
