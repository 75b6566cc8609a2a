"""Tokenizers for the Qwen2.5-VL data: a Hugging Face tokenizer directory, or a built-in byte-level one.

Both answer `encode(text) -> list[int]` (no special tokens added), `decode(ids)`, `vocab_size` and
`special_ids` (name -> id for SPECIAL_TOKENS). The model's image/video/vision-start ids must equal the
tokenizer's: `model_token_ids(tokenizer)` gives them as Qwen25VLConfig fields (tiny_config(**model_token_ids(tok))),
and `check_model_matches(tokenizer, config)` refuses a mismatch in one line."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from mm_adaptor.data.records import DataError
from mm_adaptor.data.template import default_system

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>")

# what an HF tokenizer directory's ids come from
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                   "added_tokens.json", "tokenizer.model", "vocab.txt", "chat_template.jinja", "chat_template.json")


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
        self.default_system = default_system(config)
        if self.vocab_size > config.vocab_size:
            raise DataError(f"the byte tokenizer needs ids up to {self.vocab_size - 1}; the model's vocab is "
                            f"{config.vocab_size}")
        self._names = {i: name for name, i in self.special_ids.items()}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def identity(self) -> str:
        """What its ids depend on (a data index's key)."""
        return "bytes " + json.dumps([self.special_ids, self.default_system], sort_keys=True)

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

        folder = Path(directory)
        if not folder.is_dir():
            raise DataError(f"tokenizer_model {directory}: no such directory")
        if not any((folder / name).exists() for name in ("tokenizer.json", "vocab.json", "tokenizer.model")):
            lacking = [name for name in ("tokenizer.json", "tokenizer_config.json") if not (folder / name).exists()]
            raise DataError(f"tokenizer_model {directory}: no tokenizer in it (it lacks {' and '.join(lacking)})")
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
        self.directory = directory
        self.default_system = default_system(config)

    def identity(self) -> str:
        """What its ids depend on (a data index's key): its files' content."""
        digest = hashlib.blake2b(digest_size=16)
        for path in sorted(Path(self.directory).iterdir()):
            if path.is_file() and path.name in TOKENIZER_FILES:
                digest.update(path.name.encode() + b"\0" + path.read_bytes())
        return "hf " + digest.hexdigest() + " " + json.dumps([self.special_ids, self.default_system], sort_keys=True)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False)) if text else []

    def decode(self, ids) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)


# a model of more ids than this has a real tokenizer's vocabulary (every released model: 32k and up); the byte
# tokenizer would train it on meaningless ids
BYTE_TOKENIZER_MAX_VOCAB = 4096
BYTE_TOKENIZER_NOTE = "the built-in byte tokenizer (UTF-8 bytes and 7 special ids): no tokenizer files were given"


def load_tokenizer(tokenizer_model: str | None = None, config=None, looked_in=None):
    """HFTokenizer(tokenizer_model) for a directory, else ByteTokenizer(config) (config: a Qwen25VLConfig whose
    vision token ids the byte tokenizer takes; default tiny_config()) for a model of at most
    BYTE_TOKENIZER_MAX_VOCAB ids; a larger model without tokenizer files: DataError naming `looked_in`."""
    if tokenizer_model:
        return HFTokenizer(tokenizer_model, config)
    vocab = getattr(config, "vocab_size", 0) if config is not None else 0
    if vocab > BYTE_TOKENIZER_MAX_VOCAB:
        where = f"{looked_in} has no tokenizer.json" if looked_in else "no tokenizer directory was given"
        raise DataError(f"the model's vocabulary of {vocab} ids needs its own tokenizer, and {where}: give "
                        "--tokenizer-model DIR (its tokenizer.json and tokenizer_config.json); the built-in byte "
                        f"tokenizer serves only models of at most {BYTE_TOKENIZER_MAX_VOCAB} ids")
    return ByteTokenizer(config)


def for_checkpoint(tokenizer_model: str | None, load: str | None, config):
    """--tokenizer-model, else --load's hf/ where it holds tokenizer.json, else load_tokenizer(None, ...)."""
    hf = Path(load) / "hf" if load else None
    if not tokenizer_model and hf is not None and (hf / "tokenizer.json").exists():
        tokenizer_model = str(hf)
    return load_tokenizer(tokenizer_model, config, looked_in=hf)


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
