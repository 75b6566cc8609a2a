"""`mm-adaptor generate` (greedy, Megatron model at TP1) gives transformers' generate(do_sample=False) tokens on the
same weights (a tiny HF model written by make_tiny_hf, converted with `mm-adaptor convert hf-to-mcore`), image and
prompt; transformers gets its pixels from its own image processor."""

import re
import subprocess
import sys

import pytest
from hf_converted import convert_in_process

pytest.importorskip("transformers")
pytest.importorskip("PIL")

NEW_TOKENS = 10


def _cli(*argv):
    done = subprocess.run([sys.executable, "-m", "mm_adaptor.cli", *argv], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_greedy_tokens_equal_transformers_generate(tmp_path, shapes):
    import inspect
    import os

    import torch
    from PIL import Image
    from hf_compat import slow_qwen2_vl_image_processor

    Qwen2VLImageProcessor = slow_qwen2_vl_image_processor()

    from mm_adaptor.data import load_tokenizer
    from mm_adaptor.cli.generate import prompt_inputs
    from mm_adaptor.models.qwen2_5_vl import tiny_config
    from mm_adaptor.models.qwen2_5_vl.make_tiny_hf import make_tiny_hf

    image = os.path.join(os.path.dirname(shapes), "images", "00003.png")
    prompt = "What is in the picture?"
    hf = make_tiny_hf(str(tmp_path / "hf"), seed=3)
    convert_in_process(tmp_path / "hf", tmp_path / "mcore")
    done = _cli("generate", "--load", str(tmp_path / "mcore"), "--image", image, "--prompt", prompt,
                "--max-new-tokens", str(NEW_TOKENS))
    ours = [int(t) for t in re.search(r"generated \d+ tokens: \[(.*)\]", done.stderr).group(1).split(",")]

    tokenizer = load_tokenizer(None, tiny_config())
    input_ids, _, grid = prompt_inputs(tokenizer, prompt, image)
    with Image.open(image) as picture:
        processed = Qwen2VLImageProcessor()(images=[picture.convert("RGB")], return_tensors="pt")
    assert torch.equal(processed["image_grid_thw"], grid)
    inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                  pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"])
    if "mm_token_type_ids" in inspect.signature(type(hf.model).forward).parameters:
        # transformers 5.x: the 3-D positions come from the token types its processor returns (1-D without them)
        inputs["mm_token_type_ids"] = (input_ids == tiny_config().image_token_id).int()
    with torch.no_grad():
        out = hf.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
    theirs = out[0, input_ids.shape[1]:].tolist()
    stops = {tokenizer.special_ids["<|im_end|>"], tokenizer.special_ids["<|endoftext|>"]}
    assert ours == theirs[:len(ours)], (ours, theirs)
    assert len(ours) == NEW_TOKENS or ours[-1] in stops
