"""InternVL's config reader: what the installed transformers saves (4.57: rope_theta at the text config's top;
5.x: rope_parameters) and the OpenGVLab layout's config give the same InternVLConfig; what is not built is refused
in one line naming it. InternVL3's rope_scaling "dynamic" (factor 2) is read: transformers' logits at positions below
max_position_embeddings are ours (bit for bit on the same weights as plain RoPE's), and beyond it our model refuses
(transformers would rescale RoPE there; a negative control shows that it does)."""

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
    (lambda d: d["text_config"].update(rope_scaling={"rope_type": "linear", "factor": 2.0}), "type 'linear'"),
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


def test_dynamic_rope_scaling_is_plain_rope_up_to_max_position_embeddings():
    pytest.importorskip("transformers")
    import dataclasses
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from gloo_rank import one_gloo_rank
    from internvl_reference import hf_logits, hf_model, load_hf_weights, positions, prompt
    from megatron.core import tensor_parallel

    from mm_adaptor.models.internvl import model_provider

    config = tiny_config(max_position_embeddings=24, rope_dynamic_factor=2.0)
    hf_dict = tiny_hf_config_dict(config)
    assert hf_dict["text_config"]["rope_scaling"]["rope_type"] == "dynamic"
    assert config_from_hf(hf_dict) == config_from_hf(original_config_dict(config)) == config
    reference = hf_model(config).eval()
    assert reference.config.text_config.rope_scaling["rope_type"] == "dynamic"
    short, long = prompt(config, text_lengths=(20, 2, 2)), prompt(config, text_lengths=(40, 2, 2))
    assert short.shape[1] <= 24 < long.shape[1]
    with one_gloo_rank():
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        ours = model_provider(config).eval()
        load_hf_weights(ours, reference.state_dict(), config)
        with torch.no_grad():
            assert torch.equal(ours(short, positions(short), runtime_gather_output=True), hf_logits(reference, short))
            with pytest.raises(ValueError, match=f"position {long.shape[1] - 1} is beyond max_position_embeddings 24"):
                ours(long, positions(long), runtime_gather_output=True)
            plain = model_provider(dataclasses.replace(config, rope_dynamic_factor=None)).eval()
            load_hf_weights(plain, reference.state_dict(), config)
            beyond = plain(long, positions(long), runtime_gather_output=True)
    with torch.no_grad():  # transformers rescales beyond max_position_embeddings: plain RoPE differs there
        assert not torch.allclose(beyond[:, -1], hf_logits(reference, long)[:, -1], rtol=1e-4, atol=1e-5)


def test_a_dynamic_rope_checkpoint_refuses_a_longer_seq_length_before_any_rank(tmp_path):
    """Positions beyond max_position_embeddings are where rope_scaling 'dynamic' rescales (not built): one line,
    exit 2, before any rank starts; at the limit the checks pass."""
    import importlib.util
    import json

    from mm_adaptor.harness import runner as train
    from mm_adaptor.harness.runner import LayoutError
    from mm_adaptor.data.shapes import make_shapes

    config = tiny_config(max_position_embeddings=64, rope_dynamic_factor=2.0)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(tiny_hf_config_dict(config)))
    data = make_shapes(str(tmp_path / "shapes"), count=2, seed=0)
    argv = ["--model", "internvl", "--load", str(tmp_path), "--data-path", data, "--nproc-per-node", "1",
            "--train-iters", "1", "--micro-batch-size", "1", "--lr", "1e-3"]
    if importlib.util.find_spec("megatron.training") is not None:  # the trainer refuses it before any rank
        from trainer_runs import train as trainer

        run = trainer([*argv, "--seq-length", "128"])
        err = run.err.strip().splitlines()
        assert run.status == 2 and len(err) == 1, run.err
        assert "--seq-length 128 is beyond the checkpoint's max_position_embeddings 64" in err[0], err
    with pytest.raises(LayoutError) as refused:  # and so does the harness's runner
        train.check_args(train.parse_args([*argv, "--seq-length", "128"]), 1)
    assert "--seq-length 128 is beyond the checkpoint's max_position_embeddings 64" in str(refused.value)
    args = train.parse_args([*argv, "--seq-length", "64"])
    train.finalize_args(args, 1)
    assert not [p for p in train.families.of(args).problems(args) if "max_position_embeddings" in p]
