"""Our Qwen3-VL and Qwen3-VL-MoE over 2 gloo ranks give transformers' fp32 logits, all layouts in one launch:
dense TP2 with sequence parallelism, dense PP2 uneven (3 + 1 language layers; vision tower, mergers and the two
DeepStack layers on the first stage), MoE EP2 (two experts per rank), MoE TP2 with SP (experts split by expert
TP = 2) and MoE TP2 x EP2 with expert TP 1 (the experts spread over the TP ranks).
EP2 x TP2 with expert TP 2 needs 4 ranks and is not run here.
Measured relative errors (max |ours - HF| / max |HF|, fp32): 3.3e-7 .. 5.8e-7 on every layout and prompt, with
transformers 4.57.6 and with 5.24.0; tolerance as at TP1 (test_qwen3_vl_logits.FP32_TOLERANCE).
One training step through megatron's schedule (dense TP2+SP and PP2): loss 0 .. 7.6e-8, gradients of the patch
embedding, a DeepStack merger and the output layer 1.0e-7 .. 5.7e-7 (tolerance 10 x FP32_TOLERANCE)."""

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from gloo_rank import model_parallel, a_rank, run_ranks  # noqa: E402
from qwen3_reference import (  # noqa: E402
    TRANSFORMERS_5, hf_logits, hf_model, hf_positions, load_hf_weights, token_types,
)
from test_qwen3_vl_logits import FAMILIES, FP32_TOLERANCE, prompts, relative_error  # noqa: E402

pytestmark = pytest.mark.distributed

LAYOUTS = {  # name: (family, Qwen3VLConfig fields)
    "dense_tp2_sp": ("dense", dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "dense_pp2_uneven": ("dense", dict(pipeline_model_parallel_size=2, pipeline_layers=[3, 1])),
    "moe_ep2": ("moe", dict(expert_model_parallel_size=2)),
    "moe_tp2_sp": ("moe", dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "moe_tp2_ep2_etp1": ("moe", dict(tensor_model_parallel_size=2, sequence_parallel=True,
                                     expert_model_parallel_size=2, expert_tensor_parallel_size=1)),
}
PROMPTS = ["text_only", "two_images", "image_and_video"]


def _stage_forward(model, config, ids, positions, pixels, grid, video_pixels, video_grid):
    """Logits on the last stage; the first stage of two sends its hidden states on."""
    import torch.distributed as dist

    vision = dict(pixel_values=pixels, image_grid_thw=grid, pixel_values_videos=video_pixels,
                  video_grid_thw=video_grid)
    if config.pipeline_model_parallel_size == 1:
        return model(ids, positions, runtime_gather_output=True, **vision)
    if model.pre_process:
        dist.send(model(ids, positions, **vision).contiguous(), dst=1)
        return None
    hidden = torch.empty(ids.shape[1], ids.shape[0], config.hidden_size)
    dist.recv(hidden, src=0)
    model.set_input_tensor(hidden)
    return model(ids, positions, runtime_gather_output=True)


SCHEDULED = ("dense_tp2_sp", "dense_pp2_uneven")  # also one training step through megatron's schedule


def _schedule_step(model, ids, positions, pixels, grid, video_pixels, video_grid):
    """One forward/backward through megatron's (pipeline) schedule: the loss on the last stage, gradients of the
    patch embedding and of this rank's rows of a DeepStack merger's fc1 (first stage), of this rank's rows of the
    output layer (last stage)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    labels = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    model.train()

    def loss_func(per_token):
        loss = per_token[:, :-1].mean()
        return loss, {"loss": loss.detach()}

    def forward_step(data_iterator, chunk):
        return chunk(ids, positions, labels=labels, pixel_values=pixels, image_grid_thw=grid,
                     pixel_values_videos=video_pixels, video_grid_thw=video_grid), loss_func

    reports = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]), model=[model],
                                          num_microbatches=1, seq_length=ids.shape[1], micro_batch_size=1)
    out = {}
    if model.pre_process:
        out["patch_grad"] = model.vision_model.patch_embed.proj.weight.grad.clone()
        out["deepstack_grad"] = model.deepstack_projections[0].encoder.linear_fc1.weight.grad.clone()
    if model.post_process:
        out["loss"] = reports[0]["loss"].item()
        out["output_grad"] = model.language_model.output_layer.weight.grad.clone()
    return out


def _rank_main(workdir):
    from megatron.core import parallel_state as ps

    from mm_adaptor.models.qwen3_vl import model_provider

    with a_rank(workdir) as (case, results):
        for layout, (family, fields) in LAYOUTS.items():
            config = dataclasses.replace(FAMILIES[family], **fields)
            with model_parallel(config.tensor_model_parallel_size, config.pipeline_model_parallel_size,
                                expert_model_parallel_size=config.expert_model_parallel_size,
                                expert_tensor_parallel_size=config.expert_tensor_parallel_size):
                model = model_provider(config, pre_process=ps.is_pipeline_first_stage(),
                                       post_process=ps.is_pipeline_last_stage()).eval()
                load_hf_weights(model, case["hf_state", family], config)
                results[layout, "modules"] = sorted({key.split(".")[0] for key in model.state_dict()})
                results[layout, "layers"] = [layer.layer_number for layer in model.language_model.decoder.layers]
                experts = getattr(model.language_model.decoder.layers[0].mlp, "experts", None)
                if experts is not None:
                    results[layout, "experts"] = (len(experts.local_experts),
                                                  experts.local_experts[0].linear_fc1.weight.shape[0])
                with torch.no_grad():
                    for name in PROMPTS:
                        results[layout, name] = _stage_forward(model, config, *case["prompts", family, name])
                if layout in SCHEDULED:
                    results[layout, "step"] = _schedule_step(model, *case["prompts", family, "image_and_video"])
                    results[layout, "tp_rank"] = ps.get_tensor_model_parallel_rank()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("qwen3_vl")
    case, expected = {}, {}
    for family, config in FAMILIES.items():
        reference = hf_model(config)
        case["hf_state", family] = reference.state_dict()
        all_prompts = prompts(config)
        with torch.no_grad():
            for name in PROMPTS:
                ids, pixels, grid, video_pixels, video_grid = all_prompts[name]
                positions = hf_positions(reference, config, ids, grid, video_grid)
                case["prompts", family, name] = (ids, positions, pixels, grid, video_pixels, video_grid)
                expected[family, name] = hf_logits(reference, config, ids, pixels, grid, video_pixels, video_grid)
    reference = hf_model(FAMILIES["dense"])
    ids, pixels, grid, video_pixels, video_grid = prompts(FAMILIES["dense"])["image_and_video"]
    types = {"mm_token_type_ids": token_types(FAMILIES["dense"], ids)} if TRANSFORMERS_5 else {}
    expected["loss"] = reference(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, labels=ids,
                                 pixel_values_videos=video_pixels, video_grid_thw=video_grid, **types).loss
    expected["loss"].backward()
    expected["patch_grad"] = reference.model.visual.patch_embed.proj.weight.grad.flatten(1)
    expected["deepstack_grad"] = reference.model.visual.deepstack_merger_list[0].linear_fc1.weight.grad
    expected["output_grad"] = reference.lm_head.weight.grad
    return run_ranks(_rank_main, workdir, case), expected


@pytest.mark.parametrize("name", PROMPTS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_equal_transformers(runs, layout, name):
    ranks, expected = runs
    family = LAYOUTS[layout][0]
    holders = [ranks[1]] if "pp2" in layout else ranks  # the last stage, or every rank
    for rank in holders:
        assert relative_error(rank[layout, name], expected[family, name]) < FP32_TOLERANCE
    if "tp2" in layout and "ep2" not in layout:
        assert torch.equal(ranks[0][layout, name], ranks[1][layout, name]), "TP ranks must agree"


@pytest.mark.parametrize("layout", SCHEDULED)
def test_schedule_step_loss_and_gradients_equal_transformers(runs, layout):
    """The DeepStack path's gradients come back whole to every TP rank under SP, and through the pipeline."""
    ranks, expected = runs
    first, last = (ranks[0], ranks[1]) if "pp2" in layout else (ranks[0], ranks[0])
    loss = last[layout, "step"]["loss"]
    assert abs(loss - expected["loss"].item()) < FP32_TOLERANCE * expected["loss"].item()
    for rank in ranks if "tp2" in layout else [first]:
        tp_rank, tp = rank[layout, "tp_rank"], 2 if "tp2" in layout else 1
        assert relative_error(rank[layout, "step"]["patch_grad"], expected["patch_grad"]) < 10 * FP32_TOLERANCE
        rows = expected["deepstack_grad"].chunk(tp)[tp_rank]
        assert relative_error(rank[layout, "step"]["deepstack_grad"], rows) < 10 * FP32_TOLERANCE
    for rank in ranks if "tp2" in layout else [last]:
        rows = expected["output_grad"].chunk(2 if "tp2" in layout else 1)[rank[layout, "tp_rank"]]
        assert relative_error(rank[layout, "step"]["output_grad"], rows) < 10 * FP32_TOLERANCE


def test_vision_and_deepstack_live_on_the_first_pipeline_stage_only(runs):
    ranks, _ = runs
    everything = ["deepstack_projections", "language_model", "vision_model", "vision_projection"]
    assert ranks[0]["dense_pp2_uneven", "modules"] == everything
    assert ranks[1]["dense_pp2_uneven", "modules"] == ["language_model"]
    assert ranks[0]["dense_pp2_uneven", "layers"] == [1, 2, 3] and ranks[1]["dense_pp2_uneven", "layers"] == [4]


def test_experts_are_spread_as_the_layout_says(runs):
    """(local experts, rows of an expert's fc1 = 2 * 48 / expert TP) per rank."""
    ranks, _ = runs
    for rank in ranks:
        assert rank["moe_ep2", "experts"] == (2, 96)
        assert rank["moe_tp2_sp", "experts"] == (4, 48)
        assert rank["moe_tp2_ep2_etp1", "experts"] == (2, 96)
