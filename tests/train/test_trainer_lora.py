"""LoRA fine-tuning in the trainer (MindSpeed-MM's flags): the base frozen and loaded from a whole model's
checkpoint, the adapters trained, saved alone and resumed at another layout, and exported to peft's format.

- The GPT from a trained base: the same losses at TP1, TP2 with sequence parallelism, PP2 and CP2 (the adapters' split
  factors and their gradients are whole-model ones), and a TP2 save resumes at TP1 where the straight run went on.
  Measured (CPU, fp32): 0 to 2e-7 relative between layouts and on the resume; LIMIT as for the trainer's other
  layout changes. Broken variant: the whole factors' gradients not summed over the sequence-parallel ranks (3e-3).
  Full activation recompute gives the same losses (0); broken variant: the recomputed blocks' hidden states left
  without a gradient behind the frozen embedding, so that the reentrant checkpoint hands the adapters none (4e-2).
- Qwen2.5-VL converted from HF: LoRA on both towers at TP2 + SP, its save exported with `convert lora-to-hf`; peft
  loads it on transformers' model and gives our model's logits (fp32: 2.1e-7 relative; FP32_TOLERANCE as the
  family's logit test); the adapter converted back is the save's, bit for bit; `convert merge-lora` writes peft's
  merge_and_unload weights (bit-equal here) in a checkpoint transformers loads strictly. Broken variant: the split
  factor's TP halves swapped in the export (7.1e-3) is rejected."""

import pytest

from trainer_runs import QUICK, relative_differences, scalars, train

from mm_adaptor.harness.compare import extra_feature_module

pytestmark = pytest.mark.distributed
pytest.importorskip("megatron.training")
pytest.importorskip("tensorboard")

LIMIT = 2e-5
FP32_TOLERANCE = 1e-5
MERGE_ROUNDING = 1e-6  # float32, elementwise; measured 0.0 (bit-equal here); a product's summation order may differ
TARGETS = ["--lora-target-modules", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
GPT = [*QUICK, "--global-batch-size", "4", "--micro-batch-size", "1", "--lr", "1e-2", "--swiglu", "--normalization",
       "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
# the registered features that train beside LoRA, stacked (each applies a mechanism LoRA leaves in place)
BESIDE_LORA = ["--use-flash-attn", "--use-fused-rmsnorm", "--use-fused-rotary-pos-emb", "--use-fused-swiglu",
               "--optimize-vocab-parallel-ce", "--recompute-activation-function", "--swap-attention"]
OPTIMIZER_BESIDE_LORA = ["--reuse-fp32-param"]  # bf16, distributed optimizer
ITERATIONS, SAVED = 6, 3


@pytest.fixture(scope="module")
def gpt_base(tmp_path_factory):
    """A GPT trained whole for 2 iterations (its save: the base), at TP1 on one rank."""
    path = tmp_path_factory.mktemp("gpt_base")
    run = train(["--nproc-per-node", "1", *GPT, "--train-iters", "2", "--save", str(path / "base"),
                 "--save-interval", "2"])
    assert run.status == 0, run.err[-3000:]
    return path / "base"


def _lora(tmp_path, name, base, *extra, nproc=2):
    run = train(["--nproc-per-node", str(nproc), *GPT, *TARGETS, "--lora-r", "4", "--lora-alpha", "8",
                 "--train-iters", str(ITERATIONS), "--tensorboard-dir", str(tmp_path / name), *extra] +
                (["--load", str(base)] if base else []))
    assert run.status == 0, run.err[-3000:]
    return run, scalars(tmp_path / name)


@pytest.fixture(scope="module")
def gpt_lora(gpt_base, tmp_path_factory):
    """The TP1 run (the reference) and the TP2 + SP run that saves (also LoRA alone beside the features)."""
    path = tmp_path_factory.mktemp("gpt_lora")
    straight, reference = _lora(path, "tp1", gpt_base, nproc=1)
    _, sp = _lora(path, "tp2_sp", gpt_base, *TP2_SP, "--save", str(path / "saved"), "--save-interval", str(SAVED))
    return path / "saved", straight, reference, sp


def test_gpt_lora_is_the_same_at_every_layout_and_resumes_at_another(gpt_base, gpt_lora, tmp_path):
    from megatron.core import dist_checkpointing

    saved, straight, reference, sp = gpt_lora
    assert f"LoRA: --load {gpt_base} holds the base model" in straight.out
    assert "LoRA r 4, alpha 8: 16 linears adapted" in straight.out
    assert reference[1] != reference[ITERATIONS]  # the adapters trained
    _, pp = _lora(tmp_path, "pp2", gpt_base, "--pipeline-model-parallel-size", "2")
    _, cp = _lora(tmp_path, "cp2", gpt_base, "--context-parallel-size", "2")
    for found in (sp, pp, cp):
        assert sorted(found) == sorted(reference)
        assert max(relative_differences(reference, found).values()) <= LIMIT, found
    stored = dist_checkpointing.load_tensors_metadata(str(saved / f"iter_{SAVED:07d}"))
    model_keys = [key for key in stored if not key.startswith("optimizer.")]
    assert model_keys and all(".lora_A." in key or ".lora_B." in key for key in model_keys), model_keys
    with extra_feature_module("broken_trainer_features"):
        _, broken = _lora(tmp_path, "broken", gpt_base, *TP2_SP, "--test-lora-unsummed-gradients")
    assert max(relative_differences(reference, broken).values()) > 10 * LIMIT, broken
    full_recompute = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    _, found = _lora(tmp_path, "recomputed", gpt_base, *full_recompute, nproc=1)
    assert max(relative_differences(reference, found).values()) <= LIMIT, found
    with extra_feature_module("broken_trainer_features"):
        _, broken = _lora(tmp_path, "recomputed_broken", gpt_base, *full_recompute, "--test-lora-recompute-no-grad",
                          nproc=1)
    assert max(relative_differences(reference, broken).values()) > 10 * LIMIT, broken
    _, resumed = _lora(tmp_path, "resumed", None, "--load", str(saved), "--load-base-model",
                       str(gpt_base), "--ckpt-step", str(SAVED), nproc=1)
    assert sorted(resumed) == list(range(SAVED + 1, ITERATIONS + 1))
    assert max(relative_differences(reference, resumed).values()) <= LIMIT, resumed


def test_features_train_beside_lora_or_are_refused_with_it(gpt_base, gpt_lora, tmp_path):
    """The registered features that leave the adapters' path alone train with LoRA to LoRA's own losses (their
    mechanisms applied: the banner names them); CoC, whose chunks ride on the trainable linears' path that LoRA's
    frozen bases leave, is refused with it in one line."""
    alone = gpt_lora[3]  # TP2 + SP (its --save leaves the losses alone)
    run, stacked = _lora(tmp_path, "stacked", gpt_base, *TP2_SP, *BESIDE_LORA)
    applied = next(line for line in run.out.splitlines() if "features applied:" in line)
    assert all(flag.removeprefix("--use-").removeprefix("--") in applied for flag in BESIDE_LORA), applied
    assert max(relative_differences(alone, stacked).values()) <= LIMIT, stacked
    bf16 = [*TP2_SP, "--bf16", "--use-distributed-optimizer"]
    _, plain = _lora(tmp_path, "bf16", gpt_base, *bf16)
    _, reused = _lora(tmp_path, "reused", gpt_base, *bf16, *OPTIMIZER_BESIDE_LORA)
    assert max(relative_differences(plain, reused).values()) <= LIMIT, reused
    refused = train(["--nproc-per-node", "2", *GPT, *TARGETS, *TP2_SP, "--use-coc", "--train-iters", "1"])
    assert refused.status == 2 and len(refused.err.strip().splitlines()) == 1, refused.err
    assert "LoRA (--lora-target-modules) freezes their weights" in refused.err


def test_lora_refusals_are_one_line(gpt_base, tmp_path):
    saved = tmp_path / "saved"
    first = train(["--nproc-per-node", "1", *GPT, *TARGETS, "--train-iters", "1", "--load", str(gpt_base),
                   "--save", str(saved), "--save-interval", "1"])
    assert first.status == 0, first.err[-3000:]
    cases = {
        ("--lora-target-modules", "q_proj", "k_proj"): "MindSpeed-MM's separate q/k/v and gate/up adapters",
        (*TARGETS, "--load", str(saved)): "holds LoRA adapters alone: add --load-base-model",
        (*TARGETS, "--lora-alpha", "32", "--load", str(saved), "--load-base-model", str(gpt_base)):
            "--lora-alpha 32.0: --load",
        (*TARGETS, "--load-base-model", str(saved)): "no whole model's checkpoint there",
        ("--load-base-model", str(gpt_base)): "LoRA is off (no --lora-target-modules)",
        (*TARGETS, "--ckpt-format", "torch"): "--ckpt-format torch: LoRA checkpoints hold the adapters alone",
        (*TARGETS, "--num-experts", "4", "--moe-grouped-gemm", "--use-fused-gmm"):
            "whose adapters run expert by expert (megatron's SequentialMLP)",
    }
    for flags, said in cases.items():
        run = train(["--nproc-per-node", "1", *GPT, "--train-iters", "2", *flags])
        assert run.status == 2 and len(run.err.strip().splitlines()) == 1 and said in run.err, (flags, run.err)
    # what only the built model shows: refused by the ranks once built, one line from the launcher
    run = train(["--nproc-per-node", "1", *GPT, "--train-iters", "2", "--lora-target-modules", "linear_qkvv"])
    assert run.status == 2 and "Traceback" not in run.err, run.err
    assert run.err.strip().splitlines()[-1] == ("mm-adaptor train: error: --lora-target-modules linear_qkvv: no "
                                                "module of the model is named so (outside frozen towers)"), run.err


def test_qwen2_5_vl_lora_exports_to_peft_and_back(tmp_path):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForImageTextToText

    from hf_compat import with_token_types
    from mm_adaptor.cli import main
    from mm_adaptor.convert.mcore_io import Reader
    from mm_adaptor.convert.mcore_to_hf import checkpoint_path
    from mm_adaptor.data.shapes import make_shapes
    from mm_adaptor.models.make_tiny_hf import make_tiny_hf

    make_tiny_hf(str(tmp_path / "hf"), "qwen2_5_vl", seed=3)
    shapes = make_shapes(str(tmp_path), count=8, seed=0)
    assert main(["convert", "hf-to-mcore", str(tmp_path / "hf"), str(tmp_path / "base")]) == 0
    run = train(["--nproc-per-node", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                 "--load", str(tmp_path / "base"), "--data-path", shapes, "--split", "100,0,0", "--seq-length", "256",
                 "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "2", "--lr", "5e-2", *QUICK,
                 *TARGETS, "--lora-r", "4", "--lora-alpha", "8", "--save", str(tmp_path / "saved"),
                 "--save-interval", "2"])
    assert run.status == 0, run.err[-3000:]
    assert (tmp_path / "saved" / "hf" / "config.json").is_file()
    assert main(["convert", "lora-to-hf", str(tmp_path / "saved"), str(tmp_path / "adapter")]) == 0
    hf_model = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32)
    hf_model_state = {name: tensor.clone() for name, tensor in hf_model.state_dict().items()}
    peft_model = PeftModel.from_pretrained(hf_model, str(tmp_path / "adapter")).eval()
    exported = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    adapted = {name.replace(".default", "") for name, _ in peft_model.named_parameters() if ".lora_" in name}
    assert adapted == set(exported) and any(".visual." in name for name in exported)

    got, greedy_ids, config, (ids, pixels, grid) = _ours_with_the_adapter(tmp_path)
    inputs = {"input_ids": ids, **with_token_types(config, ids, pixel_values=pixels, image_grid_thw=grid)}
    with torch.no_grad():
        expected = peft_model(**inputs).logits
        with peft_model.disable_adapter():
            plain = peft_model(**inputs).logits
    assert _relative(expected, plain) > 100 * FP32_TOLERANCE, "the trained adapters change the logits"
    assert _relative(got, expected) < FP32_TOLERANCE
    assert greedy_ids == _hf_greedy(peft_model, config, ids, pixels, grid, len(greedy_ids))  # generate --lora's

    # broken: the two TP ranks' halves of a split factor swapped (q_proj's B, split by rows at TP2)
    key = next(name for name in exported if "language_model.layers.0.self_attn.q_proj.lora_B" in name)
    swapped = dict(exported)
    first, second = exported[key].chunk(2)
    swapped[key] = torch.cat([second, first])
    save_file(swapped, str(tmp_path / "adapter" / "adapter_model.safetensors"))
    broken = PeftModel.from_pretrained(
        AutoModelForImageTextToText.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32),
        str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        wrong = broken(**inputs).logits
    assert _relative(got, wrong) > 10 * FP32_TOLERANCE
    save_file(exported, str(tmp_path / "adapter" / "adapter_model.safetensors"))

    # merged: the weights of peft's merge_and_unload, and a checkpoint transformers loads strictly
    assert main(["convert", "merge-lora", str(tmp_path / "saved"), str(tmp_path / "merged")]) == 0
    reference = peft_model.merge_and_unload().state_dict()
    merged, info = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "merged"), torch_dtype=torch.float32,
                                                               output_loading_info=True)
    assert not any(info.values()), info
    merged = merged.state_dict()
    assert sorted(merged) == sorted(reference)
    worst = max((merged[name] - reference[name]).abs().max().item() for name in merged)
    assert worst <= MERGE_ROUNDING, worst
    changed = [name for name in merged if not torch.equal(merged[name], hf_model_state[name])]
    assert any("visual" in name for name in changed) and any("language_model" in name for name in changed)

    assert main(["convert", "hf-to-mcore", str(tmp_path / "hf"), str(tmp_path / "back"), "--lora",
                 str(tmp_path / "adapter")]) == 0
    saved, back = Reader(checkpoint_path(tmp_path / "saved")), Reader(checkpoint_path(tmp_path / "back"))
    keys = sorted(key for key in saved.tensors() if ".lora_" in key and not key.startswith("optimizer."))
    assert keys == sorted(back.tensors())
    for key in keys:
        assert torch.equal(saved.read(key), back.read(key)), key
    resumed = train(["--nproc-per-node", "1", "--load", str(tmp_path / "back"), "--load-base-model",
                     str(tmp_path / "base"), "--data-path", shapes, "--split", "100,0,0", "--seq-length", "256",
                     "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1", "--lr", "5e-2",
                     *QUICK, *TARGETS, "--lora-r", "4", "--lora-alpha", "8"])
    assert resumed.status == 0, resumed.err[-3000:]
    assert "is a converted checkpoint (weights only): it starts the run as --finetune" in resumed.out


MOE = ["--model", "qwen3_vl_moe-tiny", *QUICK, "--global-batch-size", "4", "--micro-batch-size", "1", "--lr", "1e-2",
       "--moe-token-dispatcher-type", "alltoall"]
EP2_ETP2 = ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size",
            "2", "--sequence-parallel"]


def test_expert_adapters_train_alike_at_ep2_x_etp2_and_export_to_peft(tmp_path):
    """Qwen3-VL-MoE with adapters on every expert (and attention): the same losses at EP1, EP2 and EP2 x expert-TP2
    with sequence parallelism (4 ranks; measured 0 to 8.6e-8 relative), and at EP2 with --moe-zero-memory level1
    exactly EP2's; broken variant (2.4e-4): the expert factors' gradients not summed over the expert-TP group. The
    EP2 x ETP2 save exports to peft's adapters of transformers' fused experts, which give our model's logits."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from mm_adaptor.cli import main

    base = train(["--nproc-per-node", "1", *MOE, "--train-iters", "1", "--save", str(tmp_path / "base"),
                  "--save-interval", "1"])
    assert base.status == 0, base.err[-3000:]
    lora = [*MOE, *TARGETS, "--lora-r", "4", "--lora-alpha", "8", "--train-iters", "3", "--load",
            str(tmp_path / "base")]
    runs = {}
    for name, nproc, extra in (("ep1", 1, []), ("ep2", 2, ["--expert-model-parallel-size", "2"]),
                               ("ep2_zero_memory", 2, ["--expert-model-parallel-size", "2", "--moe-zero-memory",
                                                       "level1"]),
                               ("ep2_etp2", 4, [*EP2_ETP2, "--save", str(tmp_path / "saved"), "--save-interval", "3"])):
        run = train(["--nproc-per-node", str(nproc), *lora, *extra, "--tensorboard-dir", str(tmp_path / name)])
        assert run.status == 0, run.err[-3000:]
        runs[name] = scalars(tmp_path / name)
        if "--moe-zero-memory" in extra:
            assert "moe-zero-memory" in next(line for line in run.out.splitlines() if "features applied:" in line)
    for name in ("ep2", "ep2_etp2"):
        assert max(relative_differences(runs["ep1"], runs[name]).values()) <= LIMIT, runs
    # the experts' adapters recomputed with fc1 from the re-dispatched input: the same numbers
    assert runs["ep2_zero_memory"] == runs["ep2"], runs
    with extra_feature_module("broken_trainer_features"):
        broken = train(["--nproc-per-node", "4", *lora, *EP2_ETP2, "--test-lora-unsummed-expert-gradients",
                        "--tensorboard-dir", str(tmp_path / "broken")])
    assert broken.status == 0, broken.err[-3000:]
    assert max(relative_differences(runs["ep1"], scalars(tmp_path / "broken")).values()) > 10 * LIMIT

    assert main(["convert", "mcore-to-hf", str(tmp_path / "base"), str(tmp_path / "hf")]) == 0
    assert main(["convert", "lora-to-hf", str(tmp_path / "saved"), str(tmp_path / "adapter")]) == 0
    peft_model = PeftModel.from_pretrained(
        AutoModelForImageTextToText.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32),
        str(tmp_path / "adapter")).eval()
    wrapped = {name.replace(".default", "") for name, _ in peft_model.named_parameters() if ".lora_" in name}
    assert any(".experts.base_layer.lora_A" in name for name in wrapped)
    got, config, ids = _ours_on_text(tmp_path)
    from hf_compat import with_token_types

    with torch.no_grad():
        expected = peft_model(input_ids=ids, **with_token_types(config, ids)).logits
    assert _relative(got, expected) < FP32_TOLERANCE
    # the experts' adapters merged as peft merges them into transformers' fused experts
    assert main(["convert", "merge-lora", str(tmp_path / "saved"), str(tmp_path / "merged")]) == 0
    reference = peft_model.merge_and_unload().state_dict()
    merged = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).state_dict()
    assert sorted(merged) == sorted(reference)
    assert max((merged[name] - reference[name]).abs().max().item() for name in merged) <= MERGE_ROUNDING


def _ours_on_text(tmp_path):
    """Logits of our Qwen3-VL-MoE at EP1 with the base and the EP2 x ETP2 save's adapters on a text prompt."""
    import torch
    from megatron.core import tensor_parallel

    from gloo_rank import one_gloo_rank
    from mm_adaptor.cli.generate import load_model
    from mm_adaptor.models import rope_index_for

    with one_gloo_rank():
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        model, config = load_model(str(tmp_path / "base"), str(tmp_path / "saved"))
        ids = torch.tensor([[5, 17, 3, 9, 44, 2, 8, 31, 12, 6]])
        positions, _ = rope_index_for(config, ids, None)
        with torch.no_grad():
            return model(ids, positions), config, ids


def _ours_with_the_adapter(tmp_path):
    """Logits and 6 greedy tokens of our Qwen2.5-VL at TP1 with the base and the TP2 save's adapters (mm-adaptor
    generate's loader and decoding) on a prompt with an image, its config, and the prompt (ids, pixels, grid)."""
    import torch

    from gloo_rank import one_gloo_rank
    from mm_adaptor.cli.generate import greedy, load_model
    from mm_adaptor.models import rope_index_for

    from megatron.core import tensor_parallel

    with one_gloo_rank():
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        model, config = load_model(str(tmp_path / "base"), str(tmp_path / "saved"))
        generator = torch.Generator().manual_seed(5)
        grid = torch.tensor([[1, 4, 4]])
        pixels = torch.randn(16, config.patch_dim, generator=generator)
        start = config.vision_start_token_id
        ids = torch.tensor([[1, 2, 3, start, *[config.image_token_id] * 4, start + 1, 4, 5, 6]])
        positions, _ = rope_index_for(config, ids, grid)
        with torch.no_grad():
            logits = model(ids, positions, pixel_values=pixels, image_grid_thw=grid)
        new, _ = greedy(model, config, ids, pixels, grid, max_new_tokens=6)
        return logits, new, config, (ids, pixels, grid)


def _hf_greedy(model, config, ids, pixels, grid, count: int) -> list[int]:
    """The argmax of the last position, `count` times, the whole sequence run again each step (as generate's)."""
    import torch

    from hf_compat import with_token_types

    new = []
    with torch.no_grad():
        for _ in range(count):
            logits = model(input_ids=ids, **with_token_types(config, ids, pixel_values=pixels,
                                                             image_grid_thw=grid)).logits
            new.append(int(logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([[new[-1]]])], dim=1)
    return new


def _relative(ours, reference):
    return ((ours.float() - reference.float()).abs().max() / reference.float().abs().max()).item()
