"""LoRA on our Megatron Qwen2.5-VL equals peft's LoRA on transformers' model, with the same base and adapter (TP 1,
one process): the adapter goes out under peft's keys (mm_adaptor.lora.hf) and peft's own loader takes it strictly.

Measured on the tiny seeded model, fp32, relative error max |ours - peft| / max |peft|: 4.6e-7 with an image, the
adapters' own share of the logits ~0.1 (B drawn at 0.05); tolerance FP32_TOLERANCE as the family's logit test.
Broken variants: alpha / r off by 2x (2.9e-2), the shared A of q/k/v exported as rows of another layer's."""

import pytest
import torch

pytest.importorskip("peft")

from hf_reference import hf_inputs, hf_model, images, load_hf_weights, prompt  # noqa: E402

from mm_adaptor.convert.families import family_for  # noqa: E402
from mm_adaptor.lora import Settings, apply, is_adapter_key  # noqa: E402
from mm_adaptor.lora import hf as lora_hf  # noqa: E402
from mm_adaptor.models.qwen2_5_vl import model_provider, rope_index_for, tiny_config, tiny_hf_config_dict  # noqa: E402

FP32_TOLERANCE = 1e-5
CONFIG = tiny_config()
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def relative_error(ours, reference):
    return ((ours.float() - reference.float()).abs().max() / reference.float().abs().max()).item()


@pytest.fixture(scope="module")
def megatron_rank():
    from gloo_rank import one_gloo_rank
    from megatron.core import tensor_parallel

    with one_gloo_rank():
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        yield


@pytest.fixture(scope="module")
def case(megatron_rank):
    """(our model with trained-looking adapters, the HF base, the family, the prompt's inputs)."""
    base = hf_model(CONFIG)
    ours = model_provider(CONFIG).eval()
    load_hf_weights(ours, base.state_dict(), CONFIG)
    done = apply(ours, Settings(targets=TARGETS, r=4, alpha=8.0))
    generator = torch.Generator().manual_seed(3)
    for name, param in ours.named_parameters():
        if name.endswith("lora_B.weight"):
            param.data.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    pixels, grid = images()
    ids = prompt(CONFIG, grid)
    positions, _ = rope_index_for(CONFIG, ids, grid)
    return ours, base, family_for(tiny_hf_config_dict(CONFIG)), done, (ids, pixels, grid, positions)


def ours_logits(model, inputs):
    ids, pixels, grid, positions = inputs
    with torch.no_grad():
        return model(ids, positions, pixel_values=pixels, image_grid_thw=grid)


def peft_logits(base, family, tensors, adapted, tmp_path, r=4, alpha=8.0):
    """peft's PeftModel.from_pretrained on transformers' model over the exported adapter directory."""
    from peft import PeftModel
    from safetensors.torch import save_file

    out = tmp_path / "adapter"
    out.mkdir()
    peft_tensors = lora_hf.to_peft(family, tensors)
    save_file({k: v.contiguous() for k, v in peft_tensors.items()}, str(out / lora_hf.WEIGHTS_NAME))
    lora_hf.write_config(out, family, {lora_hf.module_of(k) for k in peft_tensors}, r, alpha, 0.0)
    import copy

    model = PeftModel.from_pretrained(copy.deepcopy(base), str(out)).eval()
    return model, peft_tensors


def adapter_tensors(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if is_adapter_key(k)}


def test_only_adapters_train_and_start_as_the_base(case):
    ours, _, _, done, _ = case
    trainable = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter_key(n) for n in trainable)
    assert any(n.startswith("vision_model.") for n in trainable) and any(n.startswith("language_model.")
                                                                          for n in trainable)
    assert done["trainable_elements"] == sum(ours.get_parameter(n).numel() for n in trainable)


def test_logits_equal_peft_on_transformers(case, tmp_path):
    ours, base, family, _, inputs = case
    tensors = adapter_tensors(ours)
    peft_model, peft_tensors = peft_logits(base, family, tensors, None, tmp_path)
    # peft loaded every key we wrote, and wrapped no module we left out
    loaded = {k.replace(".default", "") for k, _ in peft_model.named_parameters() if "lora_" in k}
    assert loaded == set(peft_tensors)
    ids, pixels, grid, _ = inputs
    with torch.no_grad():
        expected = peft_model(**hf_inputs(CONFIG, ids, pixel_values=pixels, image_grid_thw=grid)).logits
        plain = base(**hf_inputs(CONFIG, ids, pixel_values=pixels, image_grid_thw=grid)).logits
    got = ours_logits(ours, inputs)
    assert relative_error(expected, plain) > 100 * FP32_TOLERANCE  # the adapters change the logits
    assert relative_error(got, expected) < FP32_TOLERANCE
    assert lora_hf.from_peft(family, peft_tensors).keys() == tensors.keys()
    for key, tensor in lora_hf.from_peft(family, peft_tensors).items():
        assert torch.equal(tensor, tensors[key]), key


def test_wrong_scaling_is_rejected(case, tmp_path):
    ours, base, family, _, inputs = case
    peft_model, _ = peft_logits(base, family, adapter_tensors(ours), None, tmp_path, alpha=16.0)
    ids, pixels, grid, _ = inputs
    with torch.no_grad():
        expected = peft_model(**hf_inputs(CONFIG, ids, pixel_values=pixels, image_grid_thw=grid)).logits
    assert relative_error(ours_logits(ours, inputs), expected) > 100 * FP32_TOLERANCE
