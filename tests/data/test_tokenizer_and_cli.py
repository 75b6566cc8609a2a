"""An HF tokenizer directory (built offline) gives the template's ids; `mm-adaptor data` commands; shapes."""

import json
import os
import shutil

import numpy as np
import pytest

from mm_adaptor.cli import main as cli_main
from mm_adaptor.data import SPECIAL_TOKENS, build, load_tokenizer, model_token_ids
from mm_adaptor.data.shapes import COLOURS
from mm_adaptor.models.qwen2_5_vl import tiny_config


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["You are a helpful assistant.", "What is in the picture?", "2 red circles. 1 blue square."] * 20
    tokenizer.train_from_iterator(corpus, trainer)
    directory = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                            additional_special_tokens=list(SPECIAL_TOKENS[1:])).save_pretrained(directory)
    return str(directory)


def test_hf_tokenizer_ids_equal_the_template_string(hf_dir, shapes):
    from transformers import AutoTokenizer

    tokenizer = load_tokenizer(hf_dir)
    config = tiny_config(**model_token_ids(tokenizer))
    batch = next(build(shapes, tokenizer, config, 320, micro_batch_size=2, global_batch_size=2))
    record = json.load(open(shapes))[int(batch["sample_index"][0])]
    grid = batch["image_grid_thw"][0].tolist()
    image = "<|vision_start|>" + "<|image_pad|>" * (grid[0] * grid[1] * grid[2] // 4) + "<|vision_end|>"
    text = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
            + record["messages"][0]["content"].replace("<image>", image)
            + f"<|im_end|>\n<|im_start|>assistant\n{record['messages'][1]['content']}<|im_end|>\n")
    expected = AutoTokenizer.from_pretrained(hf_dir).encode(text, add_special_tokens=False)
    n = int(batch["num_tokens"][0])
    assert batch["input_ids"][0, :n].tolist() == expected
    assert tokenizer.decode(batch["labels"][0][batch["loss_mask"][0].bool()]) == \
        record["messages"][1]["content"] + "<|im_end|>"


def test_hf_tokenizer_without_specials_refused(tmp_path):
    from mm_adaptor.data import DataError

    with pytest.raises(DataError, match="cannot load|no special token|no tokenizer in it"):
        load_tokenizer(str(tmp_path))


def test_llava_to_messages_and_check(tmp_path, shapes, capsys):
    source = os.path.join(os.path.dirname(shapes), "images")
    llava = [{"image": "00001.png", "conversations": [{"from": "human", "value": "<image>\nWhat is it?"},
                                                       {"from": "gpt", "value": "shapes"}]},
             {"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi"}]}]
    (tmp_path / "llava.json").write_text(json.dumps(llava))
    out = tmp_path / "sub" / "messages.json"
    out.parent.mkdir()
    assert cli_main(["data", "llava-to-messages", str(tmp_path / "llava.json"), str(out),
                     "--image-folder", source]) == 0
    records = json.load(open(out))
    assert records[0]["messages"] == [{"role": "user", "content": "<image>\nWhat is it?"},
                                      {"role": "assistant", "content": "shapes"}]
    assert os.path.samefile(out.parent / records[0]["images"][0], os.path.join(source, "00001.png"))
    assert "images" not in records[1]
    assert cli_main(["data", "check", str(out), "--seq-length", "400"]) == 0
    assert "2 samples, 0 bad" in capsys.readouterr().out
    assert cli_main(["data", "check", str(out), "--seq-length", "50"]) == 1
    assert "the built-in byte tokenizer" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text(json.dumps([{"conversations": "x"}]))
    assert cli_main(["data", "llava-to-messages", str(tmp_path / "bad.json"), str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err
    assert "record 1: not a LLaVA record" in err and err.count("\n") == 1


def test_make_shapes_captions_follow_the_drawing(tmp_path):
    from PIL import Image

    assert cli_main(["data", "make-shapes", str(tmp_path), "--count", "12", "--seed", "5"]) == 0
    records = json.load(open(tmp_path / "shapes.json"))
    assert len(records) == 12 and len({r["messages"][1]["content"] for r in records}) > 4
    for record in records:
        image = Image.open(tmp_path / record["images"][0])
        assert image.width != image.height and min(image.size) >= 112
        count, colour = record["messages"][1]["content"].split()[:2]
        pixels = np.asarray(image).astype(int)
        near = np.abs(pixels - np.array(COLOURS[colour])).sum(-1) < 60
        assert _components(near) == int(count), record


def _components(mask):
    # 4-connected blobs of at least 20 pixels
    seen, blobs = np.zeros_like(mask), 0
    for start in zip(*np.nonzero(mask)):
        if seen[start]:
            continue
        stack, size = [start], 0
        seen[start] = True
        while stack:
            y, x = stack.pop()
            size += 1
            for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1] and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
        blobs += size >= 20
    return blobs


def test_mindspeed_dataset_param_names(tmp_path):
    from mm_adaptor.data import options_from_mindspeed

    param = {"dataset_type": "huggingface",
             "preprocess_parameters": {"image_max_pixels": 262144, "image_min_pixels": 3136},
             "basic_parameters": {"dataset_dir": str(tmp_path), "dataset": "a.json,b.jsonl", "max_samples": 10,
                                  "cutoff_len": 1024, "template": "qwen2vl"}}
    assert options_from_mindspeed(param) == {
        "image_max_pixels": 262144, "image_min_pixels": 3136, "max_samples": 10, "seq_length": 1024,
        "data_path": [str(tmp_path / "a.json"), str(tmp_path / "b.jsonl")]}


def test_a_missing_tokenizer_is_never_silent(tmp_path, hf_dir):
    """A released model's vocabulary without tokenizer files is refused naming where it looked; a tiny model
    takes the byte tokenizer; a directory without a tokenizer names the files it lacks."""
    from mm_adaptor.data import ByteTokenizer, DataError
    from mm_adaptor.data.tokenizer import BYTE_TOKENIZER_MAX_VOCAB, for_checkpoint

    (tmp_path / "ckpt" / "hf").mkdir(parents=True)
    large = tiny_config(vocab_size=151936)
    with pytest.raises(DataError, match=rf"151936 ids needs its own tokenizer, and {tmp_path}/ckpt/hf has no "
                                        r"tokenizer.json: give --tokenizer-model DIR"):
        for_checkpoint(None, str(tmp_path / "ckpt"), large)
    with pytest.raises(DataError, match="no tokenizer directory was given"):
        for_checkpoint(None, None, large)
    assert isinstance(for_checkpoint(None, str(tmp_path / "ckpt"), tiny_config(vocab_size=BYTE_TOKENIZER_MAX_VOCAB)),
                      ByteTokenizer)
    with pytest.raises(DataError, match=r"no tokenizer in it \(it lacks tokenizer.json and tokenizer_config.json\)"):
        for_checkpoint(str(tmp_path / "ckpt" / "hf"), None, large)
    shutil.copytree(hf_dir, tmp_path / "ckpt" / "hf", dirs_exist_ok=True)  # hf/ with a tokenizer: it is taken
    assert for_checkpoint(None, str(tmp_path / "ckpt"), tiny_config(vocab_size=512)).directory.endswith("hf")


def test_the_trainer_says_it_takes_the_byte_tokenizer_and_refuses_a_large_model_without_one(tmp_path, shapes,
                                                                                              capsys):
    from types import SimpleNamespace

    from mm_adaptor.train import vlm_data

    args = SimpleNamespace(data_path=shapes, tokenizer_model=None, load=None, seq_length=320,
                           skip_bad_samples=False, data_cache=str(tmp_path), image_min_pixels=None,
                           image_max_pixels=None)
    assert vlm_data.validate(args, tiny_config(**model_token_ids(load_tokenizer(None)))) == []
    assert capsys.readouterr().out == "data: the built-in byte tokenizer (UTF-8 bytes and 7 special ids): no " \
                                      "tokenizer files were given\n"
    problems = vlm_data.validate(args, tiny_config(vocab_size=151936))
    assert len(problems) == 1 and "needs its own tokenizer" in problems[0]
