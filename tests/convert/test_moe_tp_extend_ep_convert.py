"""The converter and --moe-tp-extend-ep's layout (experts whole, expert TP 1, EP = TP x EP) on the tiny
Qwen3-VL-MoE: hf-to-mcore checks and records the extended layout and refuses, in one line, what it cannot take; the
converted checkpoint loads on two gloo ranks as TP2 with expert TP 1 and EP 2 (each rank two whole experts), those
ranks save it again, and mcore-to-hf turns that save back into the original HF tensors, exactly."""

import json
import os

import pytest
import torch

from test_qwen3_vl_convert import _load_dir, _run, saved  # noqa: F401  (saved: the tiny models, a fixture)
from test_refusals import refuse

EXTENDED = ["--tp", "2", "--moe-tp-extend-ep"]


def test_the_extended_layout_is_checked_and_recorded(saved, tmp_path, capsys):  # noqa: F811
    _run(["hf-to-mcore", str(saved["moe"][0]), str(tmp_path / "mc"), *EXTENDED], capsys)
    layout = json.loads((tmp_path / "mc" / "mm_adaptor_convert.json").read_text())["layout"]
    assert (layout["tp"], layout["ep"], layout["moe_tp_extend_ep"]) == (2, 1, True)
    assert (layout["expert_tensor_parallel_size"], layout["expert_model_parallel_size"]) == (1, 2)
    from mm_adaptor.convert.layout import Layout

    assert Layout(2, [[2]], [[1]], 2).to_dict() == {"tp": 2, "llm_pp_layers": [[2]], "vit_pp_layers": [[1]], "ep": 2,
                                                    "pp": 1}, "without the flag, the record is as before"


@pytest.mark.parametrize("model, flags, words", [
    ("moe", ["--tp", "2", "--ep", "3", "--moe-tp-extend-ep"],
     "--moe-tp-extend-ep: the model's 4 experts do not divide over --tensor-model-parallel-size 2 x "
     "--expert-model-parallel-size 3 = 6 ranks"),
    ("moe", ["--moe-tp-extend-ep"], "--moe-tp-extend-ep with --tensor-model-parallel-size 1: nothing to extend"),
    ("dense", EXTENDED, "--moe-tp-extend-ep spreads experts over the tensor-parallel ranks: the model has none"),
])
def test_refusals(saved, tmp_path, capsys, model, flags, words):  # noqa: F811
    line = refuse(["hf-to-mcore", str(saved[model][0]), str(tmp_path / "out"), *flags], capsys, tmp_path / "out")
    assert words in line


def _rank_main(workdir):
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from gloo_rank import a_rank, model_parallel
    from mm_adaptor.models.qwen3_vl import config_from_hf, model_provider

    with a_rank(workdir) as (case, results):
        config = config_from_hf(case["config"], tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                expert_tensor_parallel_size=1)
        with model_parallel(2, expert_model_parallel_size=2, expert_tensor_parallel_size=1):
            ours = model_provider(config)
            request = ours.sharded_state_dict(prefix="", metadata={"singleton_local_shards": False})
            loaded = dist_checkpointing.load({"model": request}, os.path.join(workdir, "mc", "iter_0000000"))
            ours.load_state_dict(loaded["model"], strict=True)
            mlp = ours.language_model.decoder.layers[0].mlp
            fc1 = mlp.experts.local_experts[0].linear_fc1.weight
            results.update(ep_rank=ps.get_expert_model_parallel_rank(), local_experts=len(mlp.experts.local_experts),
                           expert_tp=ps.get_expert_tensor_parallel_world_size(), fc1_rows=fc1.shape[0],
                           attention_rows=ours.language_model.decoder.layers[0].self_attention.linear_qkv.weight
                           .shape[0])
            target = os.path.join(workdir, "saved")
            if ps.get_tensor_model_parallel_rank() == 0 and int(os.environ["RANK"]) == 0:
                os.makedirs(target, exist_ok=True)
            torch.distributed.barrier()
            dist_checkpointing.save(ours.sharded_state_dict(prefix="", metadata={"singleton_local_shards": False}),
                                    target)


@pytest.mark.distributed
def test_a_checkpoint_saved_in_the_extended_layout_converts_back_exactly(saved, tmp_path, capsys):  # noqa: F811
    from gloo_rank import run_ranks

    path, tensors = saved["moe"]
    _run(["hf-to-mcore", str(path), str(tmp_path / "mc"), *EXTENDED], capsys)
    config = json.loads((path / "config.json").read_text())
    ranks = run_ranks(_rank_main, tmp_path, {"config": config})
    text = config["text_config"]
    ffn = text["moe_intermediate_size"]
    assert [(r["ep_rank"], r["local_experts"], r["expert_tp"]) for r in ranks] == [(0, 2, 1), (1, 2, 1)]
    assert all(r["fc1_rows"] == 2 * ffn for r in ranks), "whole experts (gate and up, not sliced over TP)"
    assert ranks[0]["attention_rows"] < (text["num_attention_heads"] + 2 * text["num_key_value_heads"]) * \
        text["head_dim"], "attention stays TP-sliced"
    _run(["mcore-to-hf", str(tmp_path / "saved"), str(tmp_path / "back"), "--hf-config",
          str(tmp_path / "mc" / "hf" / "config.json")], capsys)
    back = _load_dir(tmp_path / "back")
    assert sorted(back) == sorted(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(back[name], tensor), name
