"""A tokenizer directory with Qwen2.5-VL's special tokens at their real ids (151643 on) and a word-level vocabulary
below them: what a released model's config expects of its tokenizer, built offline in a second."""

from __future__ import annotations

import functools

QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                 "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                 "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
FIRST_SPECIAL = 151643


def write(directory) -> str:
    """The tokenizer's files in `directory` (built once per process, then copied)."""
    import shutil

    shutil.copytree(_built(), directory, dirs_exist_ok=True)
    return str(directory)


@functools.lru_cache(maxsize=1)
def _built() -> str:
    import tempfile

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(1, FIRST_SPECIAL)}
    vocab["[unk]"] = 0
    vocab.update({token: FIRST_SPECIAL + i for i, token in enumerate(QWEN_SPECIALS)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[unk]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[unk]", eos_token="<|endoftext|>",
                            additional_special_tokens=list(QWEN_SPECIALS[1:])).save_pretrained(
        directory := tempfile.mkdtemp(prefix="qwen-shaped-tokenizer-"))
    return directory
