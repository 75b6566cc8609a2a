"""LoRA on our Megatron models equals peft's LoRA on transformers' model, with the same base and adapter (TP 1, one
process), for Qwen2.5-VL, Qwen3-VL and InternVL: the adapter goes out under peft's keys (mm_adaptor.lora.hf), peft's
own loader takes it strictly (every key ours, every module it wrapped ours), and it comes back bit for bit. On
Qwen3-VL-MoE every expert carries its own adapter, which peft holds as adapters of transformers' fused experts
parameters (target_parameters: A [E r, in], B [out, E r] with expert e's columns e, e + E, ...).

Every linear of both towers and the projector carries an adapter (B drawn at 0.05, so that the adapters move the
logits by 0.7 to 1.1 relative). Measured, fp32, relative error max |ours - peft| / max |peft| on a prompt with an
image: Qwen2.5-VL 5.3e-7, Qwen3-VL 5.0e-7, Qwen3-VL-MoE 5.8e-7, InternVL 2.2e-7 (transformers 5.24, peft 0.21.2);
tolerance FP32_TOLERANCE, the families' logit tests'. Broken variants: alpha / r off by 2x (0.64 to 0.80); experts 0
and 1 exchanging adapters (0.12)."""

import copy

import pytest
import torch

pytest.importorskip("peft")

from mm_adaptor.convert.families import family_for  # noqa: E402
from mm_adaptor.lora import Settings, apply, is_adapter_key  # noqa: E402
from mm_adaptor.lora import hf as lora_hf  # noqa: E402

FP32_TOLERANCE = 2e-6
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
R, ALPHA = 4, 8.0


def relative_error(ours, reference):
    return ((ours.float() - reference.float()).abs().max() / reference.float().abs().max()).item()


def qwen2_5_vl():
    """(our model, HF model, HF config dict, our logits(model), HF logits(model))."""
    import hf_reference as ref

    from mm_adaptor.models.qwen2_5_vl import model_provider, rope_index_for, tiny_config, tiny_hf_config_dict

    config = tiny_config()
    hf = ref.hf_model(config)
    ours = model_provider(config).eval()
    ref.load_hf_weights(ours, hf.state_dict(), config)
    pixels, grid = ref.images()
    ids = ref.prompt(config, grid)
    positions, _ = rope_index_for(config, ids, grid)
    return (ours, hf, tiny_hf_config_dict(config),
            lambda model: model(ids, positions, pixel_values=pixels, image_grid_thw=grid),
            lambda model: model(**ref.hf_inputs(config, ids, pixel_values=pixels, image_grid_thw=grid)).logits)


def qwen3_vl(moe: bool = False):
    import qwen3_reference as ref

    from mm_adaptor.models.qwen3_vl import model_provider, tiny_config, tiny_hf_config_dict

    config = tiny_config(moe=moe)
    hf = ref.hf_model(config)
    ours = model_provider(config).eval()
    ref.load_hf_weights(ours, hf.state_dict(), config)
    pixels, grid = ref.images()
    ids = ref.prompt(config, grid[:1])
    pixels = pixels[:int(grid[0].prod())]
    positions = ref.hf_positions(hf, config, ids, grid[:1])
    return (ours, hf, tiny_hf_config_dict(config),
            lambda model: model(ids, positions, pixel_values=pixels, image_grid_thw=grid[:1]),
            lambda model: ref.hf_logits(model, config, ids, pixels, grid[:1]))


def internvl():
    import internvl_reference as ref

    from mm_adaptor.models.internvl import model_provider, tiny_config, tiny_hf_config_dict

    config = tiny_config("300m")
    hf = ref.hf_model(config)
    ours = model_provider(config).eval()
    ref.load_hf_weights(ours, hf.state_dict(), config, "native")
    ids, pixels = ref.prompts(config)["one_tile"]
    return (ours, hf, tiny_hf_config_dict(config),
            lambda model: model(ids, ref.positions(ids), pixel_values=pixels),
            lambda model: ref.hf_logits(model, ids, pixels))


FAMILIES = {"qwen2_5_vl": qwen2_5_vl, "qwen3_vl": qwen3_vl, "qwen3_vl_moe": lambda: qwen3_vl(moe=True),
            "internvl": internvl}


@pytest.fixture(scope="module")
def megatron_rank():
    from gloo_rank import one_gloo_rank
    from megatron.core import tensor_parallel

    with one_gloo_rank():
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        yield


@pytest.fixture(scope="module", params=list(FAMILIES))
def case(request, megatron_rank):
    from mm_adaptor.convert import installed_transformers_major

    if request.param == "qwen3_vl_moe" and installed_transformers_major() < 5:
        pytest.skip("expert adapters go to peft's format for transformers 5's fused experts (4.x is refused)")
    ours, hf, hf_config, ours_logits, hf_logits = FAMILIES[request.param]()
    done = apply(ours, Settings(targets=TARGETS, r=R, alpha=ALPHA))
    generator = torch.Generator().manual_seed(3)
    for name, param in ours.named_parameters():
        if name.endswith("lora_B.weight"):
            param.data.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    with torch.no_grad():
        logits = ours_logits(ours)
    adapters = {k: v.detach().clone() for k, v in ours.state_dict().items() if is_adapter_key(k)}
    return {"ours": ours, "hf": hf, "family": family_for(hf_config), "done": done, "logits": logits,
            "adapters": adapters, "hf_logits": hf_logits}


def peft_model(case, tmp_path, alpha=ALPHA):
    """peft's PeftModel.from_pretrained on (a copy of) transformers' model over the exported adapter directory."""
    from peft import PeftModel
    from safetensors.torch import save_file

    per_expert = lora_hf.per_expert_peft(case["family"], case["adapters"])
    tensors = lora_hf.fuse_experts(per_expert, case["family"].num_experts)
    out = tmp_path / f"adapter-{alpha}"
    out.mkdir()
    save_file(tensors, str(out / lora_hf.WEIGHTS_NAME))
    lora_hf.write_config(out, case["family"], lora_hf.peft_targets(per_expert), R, alpha, 0.0)
    return PeftModel.from_pretrained(copy.deepcopy(case["hf"]), str(out)).eval(), tensors, per_expert


def test_only_adapters_train(case):
    ours, done = case["ours"], case["done"]
    trainable = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter_key(n) for n in trainable)
    for tower in ("vision_model.", "vision_projection.", "language_model."):
        assert any(n.startswith(tower) for n in trainable), tower
    assert done["trainable_elements"] == sum(ours.get_parameter(n).numel() for n in trainable)


def test_logits_equal_peft_on_transformers(case, tmp_path):
    model, tensors, per_expert = peft_model(case, tmp_path)
    wrapped = {k.replace(".default", "") for k, _ in model.named_parameters() if ".lora_" in k}
    assert wrapped == set(tensors)
    with torch.no_grad():
        expected = case["hf_logits"](model)
        plain = case["hf_logits"](case["hf"])
    assert relative_error(expected, plain) > 1e4 * FP32_TOLERANCE  # the adapters move the logits
    assert relative_error(case["logits"], expected) < FP32_TOLERANCE
    back = lora_hf.from_peft(case["family"], tensors, lora_hf.peft_targets(per_expert)[1])
    assert back.keys() == case["adapters"].keys()
    assert all(torch.equal(back[key], case["adapters"][key]) for key in back)


def test_wrong_scaling_is_rejected(case, tmp_path):
    model, _, _ = peft_model(case, tmp_path, alpha=2 * ALPHA)
    with torch.no_grad():
        expected = case["hf_logits"](model)
    assert relative_error(case["logits"], expected) > 1e4 * FP32_TOLERANCE


def test_an_experts_adapter_on_its_neighbour_is_rejected(case, tmp_path):
    """Experts 0 and 1 of every MoE layer exchange adapters: peft's logits move off ours."""
    import re

    if not case["family"].num_experts:
        pytest.skip("no experts")
    swapped = {re.sub(r"local_experts\.([01])\.", lambda m: f"local_experts.{1 - int(m[1])}.", key): tensor
               for key, tensor in case["adapters"].items()}
    model, _, _ = peft_model({**case, "adapters": swapped}, tmp_path)
    with torch.no_grad():
        expected = case["hf_logits"](model)
    assert relative_error(case["logits"], expected) > 100 * FP32_TOLERANCE
