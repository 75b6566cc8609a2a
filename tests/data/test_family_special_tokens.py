"""Each family's own special tokens reach the data: a real InternVL tokenizer holds Qwen's <|vision_start|> and
<|image_pad|> as well as its own <img>, </img>, <IMG_CONTEXT>, and an image must become <img> + <IMG_CONTEXT> x n
+ </img> with the ids the tokenizer gives them (Qwen2.5-VL keeps <|vision_start|>/<|image_pad|>)."""

import json

import pytest

from mm_adaptor.data import DataError, build
from mm_adaptor.data.tokenizer import SPECIAL_TOKENS, load_tokenizer, model_token_ids

INTERNVL_TOKENS = ["<img>", "</img>", "<IMG_CONTEXT>"]  # consecutive, as in InternVL3's vocab (151665 .. 151667)


def save_tokenizer(directory, specials):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["You are a helpful assistant.", "What is in the picture?"] * 10, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                            additional_special_tokens=specials).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def internvl_tokenizer_dir(tmp_path_factory):
    return save_tokenizer(tmp_path_factory.mktemp("internvl-tok"), list(SPECIAL_TOKENS[1:]) + INTERNVL_TOKENS)


def first_batch(shapes, tokenizer, config, processing=None):
    batch = next(build(shapes, tokenizer, config, 4096, micro_batch_size=1, global_batch_size=1,
                       processing=processing))
    return batch["input_ids"][0, :int(batch["num_tokens"][0])].tolist()


def test_internvl_images_take_the_tokenizers_img_and_img_context(internvl_tokenizer_dir, shapes):
    from transformers import AutoTokenizer

    from mm_adaptor.models.internvl import tiny_config
    from mm_adaptor.models.internvl.tiles import Tiling

    hf = AutoTokenizer.from_pretrained(internvl_tokenizer_dir)
    img, end, context = hf.convert_tokens_to_ids(INTERNVL_TOKENS)
    config = tiny_config(image_token_id=context)
    tokenizer = load_tokenizer(internvl_tokenizer_dir, config)
    assert model_token_ids(tokenizer)["image_token_id"] == context
    ids = first_batch(shapes, tokenizer, config, Tiling.for_model(config))
    assert context in ids and img in ids and end in ids
    for qwen in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"):
        assert hf.convert_tokens_to_ids(qwen) not in ids, qwen
    opened = [i for i, t in enumerate(ids) if t == img]
    assert all(ids[i + 1] == context for i in opened)


def test_qwen_keeps_its_own_names(internvl_tokenizer_dir, shapes):
    from transformers import AutoTokenizer

    from mm_adaptor.models.qwen2_5_vl import tiny_config

    hf = AutoTokenizer.from_pretrained(internvl_tokenizer_dir)
    tokenizer = load_tokenizer(internvl_tokenizer_dir)
    ids = first_batch(shapes, tokenizer, tiny_config(**model_token_ids(tokenizer)))
    assert hf.convert_tokens_to_ids("<|image_pad|>") in ids
    assert not set(hf.convert_tokens_to_ids(INTERNVL_TOKENS)) & set(ids)


def test_qwens_names_for_internvl_are_refused(internvl_tokenizer_dir, monkeypatch):
    """The broken variant: InternVL read under Qwen's names takes <|image_pad|> for its image token, which the
    model's <IMG_CONTEXT> id then refuses."""
    from transformers import AutoTokenizer

    import mm_adaptor.models.internvl as internvl
    from mm_adaptor.data.tokenizer import check_model_matches
    from mm_adaptor.models.internvl import tiny_config

    context = AutoTokenizer.from_pretrained(internvl_tokenizer_dir).convert_tokens_to_ids("<IMG_CONTEXT>")
    config = tiny_config(image_token_id=context)
    check_model_matches(load_tokenizer(internvl_tokenizer_dir, config), config)
    monkeypatch.setattr(internvl, "TOKEN_NAMES", {})
    with pytest.raises(DataError, match="token ids differ"):
        check_model_matches(load_tokenizer(internvl_tokenizer_dir, config), config)


def test_a_tokenizer_without_img_context_is_refused(tmp_path):
    from mm_adaptor.models.internvl import tiny_config

    directory = save_tokenizer(tmp_path, list(SPECIAL_TOKENS[1:]) + ["<img>", "</img>"])
    with pytest.raises(DataError, match="no special token <IMG_CONTEXT>"):
        load_tokenizer(directory, tiny_config())


def test_the_shapes_file_has_an_image(shapes):
    assert any("<image>" in m["content"] for r in json.load(open(shapes)) for m in r["messages"])
