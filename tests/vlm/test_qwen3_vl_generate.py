"""`mm-adaptor generate --json` on converted tiny Qwen3-VL checkpoints (mm_adaptor.models.make_tiny_hf, then
`mm-adaptor convert hf-to-mcore`) gives the tokens of transformers' generate(do_sample=False) on the same prompt
ids and pixels, at TP1 and TP2 for the dense model and at EP2 for the MoE one, and its log-probabilities equal
transformers' scores within LOGPROB_TOLERANCE (measured 2026-11-26, fp32: 0 at TP1, 4.8e-7 at TP2 and EP2)."""

import json
import subprocess
import sys

import pytest
from hf_converted import convert_in_process

pytest.importorskip("transformers")
pytest.importorskip("PIL")

pytestmark = pytest.mark.distributed

NEW_TOKENS = 6
LOGPROB_TOLERANCE = 1e-4
PROMPT = "What is in the picture?"


def _cli(*argv):
    done = subprocess.run([sys.executable, "-m", "mm_adaptor.cli", *argv], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from mm_adaptor.models.make_tiny_hf import make_tiny_hf

    made = {}
    for model in ("qwen3_vl", "qwen3_vl_moe"):
        root = tmp_path_factory.mktemp(model)
        hf = make_tiny_hf(str(root / "hf"), model, seed=5)
        convert_in_process(root / "hf", root / "mcore")
        made[model] = (hf, root / "mcore")
    return made


def _theirs(hf, prompt_ids, image):
    import torch
    from PIL import Image

    from mm_adaptor.data.images import QWEN3_VL

    with Image.open(image) as picture:
        pixels, grid = QWEN3_VL.preprocess(picture)
    from hf_compat import with_token_types

    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=torch.from_numpy(pixels),
                          image_grid_thw=torch.tensor([list(grid)]), do_sample=False, max_new_tokens=NEW_TOKENS,
                          eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
                          **with_token_types(hf.config, ids))
    new = out.sequences[0, ids.shape[1]:].tolist()
    logprobs = [float(torch.log_softmax(score[0].float(), -1)[t]) for score, t in zip(out.scores, new)]
    return new, logprobs


CASES = {"dense_tp1": ("qwen3_vl", []), "dense_tp2": ("qwen3_vl", ["--tensor-model-parallel-size", "2"]),
         "moe_ep2": ("qwen3_vl_moe", ["--expert-model-parallel-size", "2"])}


@pytest.mark.parametrize("case", list(CASES))
def test_generate_json_equals_transformers(converted, shapes, case):
    import os

    model, layout = CASES[case]
    hf, mcore = converted[model]
    image = os.path.join(os.path.dirname(shapes), "images", "00003.png")
    done = _cli("generate", "--load", str(mcore), "--image", image, "--prompt", PROMPT, "--max-new-tokens",
                str(NEW_TOKENS), "--json", *layout)
    ours = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(ours) == {"prompt_ids", "new_ids", "text", "logprobs"}
    new, logprobs = _theirs(hf, ours["prompt_ids"], image)
    assert ours["new_ids"] == new[:len(ours["new_ids"])] and len(ours["new_ids"]) == NEW_TOKENS, (ours, new)
    assert max(abs(a - b) for a, b in zip(ours["logprobs"], logprobs)) < LOGPROB_TOLERANCE, (ours, logprobs)


def test_generate_refuses_a_layout_the_model_cannot_take(converted, capsys):
    from mm_adaptor.cli.generate import main

    _, mcore = converted["qwen3_vl"]
    with pytest.raises(SystemExit) as exit_:
        main(["--load", str(mcore), "--prompt", "hi", "--expert-model-parallel-size", "2"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the model has no experts" in err[0], err
