"""InternVL's config reader: what the installed transformers saves (4.57: rope_theta at the text config's top;
5.x: rope_parameters) and the OpenGVLab layout's config give the same InternVLConfig; what is not built is refused
in one line naming it."""

import pytest

from mm_adaptor.models.internvl import config_from_hf, original_config_dict, tiny_config, tiny_hf_config_dict


@pytest.mark.parametrize("variant", ["300m", "6b"])
def test_both_layouts_and_the_installed_transformers_config_read_the_same(variant):
    transformers = pytest.importorskip("transformers")
    config = tiny_config(variant)
    saved = transformers.InternVLConfig(**tiny_hf_config_dict(config)).to_dict()
    assert config_from_hf(saved) == config_from_hf(original_config_dict(config)) == config


@pytest.mark.parametrize("change,words", [
    (lambda d: d["text_config"].update(rope_scaling={"type": "yarn", "factor": 4.0}), "rope_scaling type 'yarn'"),
    (lambda d: d["text_config"].update(use_sliding_window=True), "sliding-window"),
    (lambda d: d["text_config"].update(model_type="llama"), "language model 'llama' is not built"),
    (lambda d: d.update(vision_feature_select_strategy="full"), "vision_feature_select_strategy"),
    (lambda d: d["vision_config"].update(use_mean_pooling=False), "use_mean_pooling"),
    (lambda d: d.update(downsample_ratio=0.3), "downsample_ratio 0.3"),
    (lambda d: d.update(image_seq_length=16), "image_seq_length 16"),
    (lambda d: d.update(model_type="llava"), "model_type 'llava' is not InternVL"),
])
def test_refusals(change, words):
    config = tiny_hf_config_dict()
    change(config)
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        config_from_hf(config)


def test_original_layout_refuses_the_v1_pixel_shuffle():
    with pytest.raises(ValueError, match="ps_version 'v1'"):
        config_from_hf({**original_config_dict(tiny_config()), "ps_version": "v1"})
