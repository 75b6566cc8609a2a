#!/usr/bin/env bash
# A tiny Qwen2.5-VL end to end, offline (README: "Vision-language models: a worked example"):
# HF checkpoint from a config -> Megatron dist checkpoint -> fine-tune at TP2 on the generated shapes data with the
# vision encoder frozen -> HF again -> transformers and mm-adaptor generate the same answer.
# Usage: scripts/vlm_example.sh [OUT_DIR]   (needs the vlm extra: transformers, safetensors, pillow)
set -euo pipefail
OUT=${1:-/tmp/mm-adaptor-vlm-example}
rm -rf "$OUT" && mkdir -p "$OUT"
IMAGE="$OUT/data/images/00000.png"
PROMPT="What is in the picture?"

python -m mm_adaptor.models.qwen2_5_vl.make_tiny_hf "$OUT/hf"
mm-adaptor convert hf-to-mcore "$OUT/hf" "$OUT/mcore" --tensor-model-parallel-size 2
mm-adaptor data make-shapes "$OUT/data" --count 32
mm-adaptor train --model qwen2_5_vl --load "$OUT/mcore" --data-path "$OUT/data/shapes.json" \
    --tensor-model-parallel-size 2 --seq-length 256 --train-iters 20 --lr 1e-2 --freeze-vision --log-tps \
    --log-interval 5 --save "$OUT/trained"
mm-adaptor convert mcore-to-hf "$OUT/trained" "$OUT/hf-trained"
python - "$OUT/hf-trained" "$IMAGE" "$PROMPT" <<'PY'
import sys

import torch
from PIL import Image
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor

from mm_adaptor.data import load_tokenizer
from mm_adaptor.cli.generate import prompt_inputs
from mm_adaptor.models.qwen2_5_vl import tiny_config

hf_dir, image, prompt = sys.argv[1:]
model = Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir).eval()
tokenizer = load_tokenizer(None, tiny_config())  # the built-in byte tokenizer the tiny model was trained with
input_ids, _, _ = prompt_inputs(tokenizer, prompt, image)
with Image.open(image) as picture:
    pixels = Qwen2VLImageProcessor()(images=[picture.convert("RGB")], return_tensors="pt")
out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                     max_new_tokens=16, eos_token_id=tokenizer.special_ids["<|im_end|>"], pad_token_id=0, **pixels)
print("transformers:", repr(tokenizer.decode(out[0, input_ids.shape[1]:].tolist()).replace("<|im_end|>", "")))
PY
echo "mm-adaptor generate: $(mm-adaptor generate --load "$OUT/trained" --image "$IMAGE" --prompt "$PROMPT" \
    --max-new-tokens 16 2>/dev/null | python -c 'import sys; print(repr(sys.stdin.read().rstrip("\n")))')"
