"""Reading Hugging Face config dicts the way transformers 4.57 and 5.x both save them.

- The language model's values sit at config.json's top level (released checkpoints) or under `text_config`
  (what transformers >= 4.5x saves); `text_config` wins where both have a key.
- Rotary settings: 4.x writes `rope_theta` beside a `rope_scaling` dict (`type`/`rope_type`, `mrope_section`,
  `mrope_interleaved`); 5.x writes one `rope_parameters` dict holding `rope_theta` and the rest. Either may sit at
  the top level or in `text_config`.
- Tied embeddings: 4.x reads text_config's flag, 5.x the top-level one (see `tied`); `saved_by` says which wrote it.
"""

from __future__ import annotations

from dataclasses import dataclass


def config_dict(config) -> dict:
    return config if isinstance(config, dict) else config.to_dict()


def text_config(config) -> dict:
    cfg = config_dict(config)
    return {**cfg, **(cfg.get("text_config") or {})}


def vision_config(config) -> dict:
    return dict(config_dict(config).get("vision_config") or {})


def saved_by(config) -> int | None:
    """The major version of the transformers that wrote the config (its `transformers_version`), None if unsaid."""
    major = str(config_dict(config).get("transformers_version") or "").split(".")[0]
    return int(major) if major.isdigit() else None


def tied(config) -> bool:
    """Whether lm_head shares the embedding, as the transformers that saved the config decides it: 5.x by the
    top-level flag (which it writes, having folded an older text_config flag into it), 4.x by text_config's flag
    where the config has one (a top-level flag beside it is ignored), else the top-level flag; False when absent."""
    cfg = config_dict(config)
    if (saved_by(cfg) or 0) >= 5 and "tie_word_embeddings" in cfg:
        return bool(cfg["tie_word_embeddings"])
    text = cfg.get("text_config")
    if isinstance(text, dict) and "tie_word_embeddings" in text:
        return bool(text["tie_word_embeddings"])
    return bool(cfg.get("tie_word_embeddings", False))


@dataclass(frozen=True)
class Rope:
    theta: float
    mrope_section: tuple[int, ...] | None
    interleaved: bool
    spelling: str  # "rope_scaling" (4.x) or "rope_parameters" (5.x): what the config used, for messages


def rope(config, default_theta: float = 10000.0) -> Rope:
    """The rotary settings in either spelling (see the module's docstring)."""
    cfg = config_dict(config)
    text = text_config(cfg)
    for spelling in ("rope_parameters", "rope_scaling"):
        found = text.get(spelling) or cfg.get(spelling)
        if isinstance(found, dict):
            params = found
            break
    else:
        params, spelling = {}, "rope_scaling"
    theta = params.get("rope_theta", text.get("rope_theta", cfg.get("rope_theta", default_theta)))
    section = params.get("mrope_section")
    return Rope(theta=float(theta), mrope_section=tuple(section) if section else None,
                interleaved=bool(params.get("mrope_interleaved", False)), spelling=spelling)


def model_type(config) -> str | None:
    return config_dict(config).get("model_type")
