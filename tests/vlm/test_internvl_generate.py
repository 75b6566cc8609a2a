"""`mm-adaptor generate --json` on a converted tiny InternVL checkpoint (mm_adaptor.models.make_tiny_hf --model
internvl, then `mm-adaptor convert hf-to-mcore`) gives the tokens of transformers' generate(do_sample=False) on the
same prompt ids and pixels (the picture tiled by models/internvl/tiles.py from the checkpoint's
preprocessor_config.json: 3 tiles and the thumbnail), and its log-probabilities equal transformers' scores within
LOGPROB_TOLERANCE (test_qwen3_vl_generate's)."""

import json
import os

import pytest
from hf_converted import convert_in_process

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from test_qwen3_vl_generate import LOGPROB_TOLERANCE, NEW_TOKENS, PROMPT, _cli  # noqa: E402

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from mm_adaptor.models.make_tiny_hf import make_tiny_hf

    root = tmp_path_factory.mktemp("internvl")
    hf = make_tiny_hf(str(root / "hf"), "internvl", seed=5)
    convert_in_process(root / "hf", root / "mcore")
    return hf, root


def _theirs(hf, root, prompt_ids, image):
    import torch
    from PIL import Image

    from mm_adaptor.models.internvl import config_from_hf
    from mm_adaptor.models.internvl.tiles import Tiling

    tiling = Tiling.for_model(config_from_hf(hf.config.to_dict()), Tiling.for_directory(root / "hf"))
    with Image.open(image) as picture:
        pixels, grid = tiling.preprocess(picture)
    assert prompt_ids.count(hf.config.image_token_id) == grid[0] * tiling.tokens_per_tile
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=torch.from_numpy(pixels),
                          do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0,
                          output_scores=True, return_dict_in_generate=True)
    new = out.sequences[0, ids.shape[1]:].tolist()
    logprobs = [float(torch.log_softmax(score[0].float(), -1)[t]) for score, t in zip(out.scores, new)]
    return new, logprobs, grid[0]


def test_generate_json_equals_transformers(converted, shapes):
    hf, root = converted
    image = os.path.join(os.path.dirname(shapes), "images", "00003.png")
    done = _cli("generate", "--load", str(root / "mcore"), "--image", image, "--prompt", PROMPT, "--max-new-tokens",
                str(NEW_TOKENS), "--json")
    ours = json.loads(done.stdout.strip().splitlines()[-1])
    new, logprobs, tiles = _theirs(hf, root, ours["prompt_ids"], image)
    assert tiles > 1, "the picture should be tiled (several tiles and the thumbnail)"
    assert ours["new_ids"] == new and len(new) == NEW_TOKENS, (ours, new)
    assert max(abs(a - b) for a, b in zip(ours["logprobs"], logprobs)) < LOGPROB_TOLERANCE, (ours, logprobs)
