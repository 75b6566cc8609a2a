"""Tokenizers for the Qwen2.5-VL data: a Hugging Face tokenizer directory, or a built-in byte-level one.

Both answer `encode(text) -> list[int]` (no special tokens added), `decode(ids)`, `vocab_size` and
`special_ids` (name -> id for SPECIAL_TOKENS). The model's image/video/vision-start ids must equal the
tokenizer's: `model_token_ids(tokenizer)` gives them as Qwen25VLConfig fields (tiny_config(**model_token_ids(tok))),
and `check_model_matches(tokenizer, config)` refuses a mismatch in one line."""

from __future__ import annotations

from mm_adaptor.data.records import DataError

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>")


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; the special tokens at the model config's ids where it names them (image pad,
    video pad, vision start, and vision end = vision start + 1, as tiny_hf_config_dict), the others at the lowest
    free ids from 256. Fits any vocab of at least 256 + 7 and the vision ids."""

    def __init__(self, config=None):
        from mm_adaptor.models.qwen2_5_vl import tiny_config

        config = config or tiny_config()
        fixed = model_token_ids_of(config)
        taken, free = set(fixed.values()), iter(i for i in range(256, 1 << 31) if i not in set(fixed.values()))
        if min(taken) < 256:
            raise DataError(f"the model's vision token ids {sorted(taken)} overlap the byte tokenizer's ids 0..255")
        self.special_ids = {name: fixed[name] if name in fixed else next(free) for name in SPECIAL_TOKENS}
        self.vocab_size = max(self.special_ids.values()) + 1
        self.model_vocab_size = config.vocab_size
        if self.vocab_size > config.vocab_size:
            raise DataError(f"the byte tokenizer needs ids up to {self.vocab_size - 1}; the model's vocab is "
                            f"{config.vocab_size}")
        self._names = {i: name for name, i in self.special_ids.items()}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        out, run = [], bytearray()
        for i in (int(i) for i in ids):
            if i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            out.append(self._names.get(i, f"<|{i}|>"))
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


def token_names(config) -> dict:
    """What the family's tokenizer calls the tokens SPECIAL_TOKENS names (Qwen's names): its package's TOKEN_NAMES
    (InternVL: <img>, </img>, <IMG_CONTEXT>; None: the family has no such token), the same name otherwise."""
    if config is None:
        return {}
    from mm_adaptor.models import family_package

    return getattr(family_package(config), "TOKEN_NAMES", {})


class HFTokenizer:
    """transformers' AutoTokenizer from a local directory (offline); it must hold SPECIAL_TOKENS under the names the
    config's family gives them (token_names). A token the family does not have takes the config's id for it."""

    def __init__(self, directory: str, config=None):
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise DataError(f"tokenizer_model {directory}: cannot load a tokenizer ({exc})") from None
        unknown, renamed = self.hf.unk_token_id, token_names(config)
        self.special_ids = {}
        for name in SPECIAL_TOKENS:
            actual = renamed.get(name, name)
            if actual is None:
                self.special_ids[name] = model_token_ids_of(config)[name]
                continue
            token_id = self.hf.convert_tokens_to_ids(actual)
            if token_id is None or (token_id == unknown and actual != self.hf.unk_token):
                raise DataError(f"tokenizer_model {directory}: no special token {actual}")
            self.special_ids[name] = int(token_id)
        self.vocab_size = len(self.hf)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False)) if text else []

    def decode(self, ids) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)


def load_tokenizer(tokenizer_model: str | None = None, config=None):
    """HFTokenizer(tokenizer_model) for a directory, else ByteTokenizer(config) (config: a Qwen25VLConfig whose
    vision token ids the byte tokenizer takes; default tiny_config())."""
    if tokenizer_model:
        return HFTokenizer(tokenizer_model, config)
    return ByteTokenizer(config)


def model_token_ids(tokenizer) -> dict:
    """The Qwen25VLConfig fields that must follow the tokenizer: image_token_id, video_token_id,
    vision_start_token_id (vision end is vision start + 1 in both Qwen's vocab and the byte tokenizer)."""
    ids = tokenizer.special_ids
    return {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"]}


def model_token_ids_of(config) -> dict:
    """The config's ids of the tokens model_token_ids reads, by token (Qwen's names)."""
    return {"<|image_pad|>": config.image_token_id, "<|video_pad|>": config.video_token_id,
            "<|vision_start|>": config.vision_start_token_id, "<|vision_end|>": config.vision_start_token_id + 1}


def check_model_matches(tokenizer, config) -> None:
    """DataError, in one line, where the model's special ids or vocab do not fit the tokenizer."""
    wrong = [f"{field}={getattr(config, field)} (tokenizer: {value})"
             for field, value in model_token_ids(tokenizer).items() if getattr(config, field) != value]
    if wrong:
        raise DataError("the model's token ids differ from the tokenizer's: " + ", ".join(wrong))
    if tokenizer.vocab_size > config.vocab_size:
        raise DataError(f"the tokenizer's {tokenizer.vocab_size} ids do not fit the model's vocab of "
                        f"{config.vocab_size}")
