"""The converted checkpoint loads into the Qwen2.5-VL model at TP2 and at PP2 (uneven 1 + 3 language layers) over
2 gloo ranks: megatron's dist_checkpointing reshards it, and every rank's local tensors equal the shards that the
model's own test helper (tests/models/hf_reference.megatron_shard, checked there against transformers' logits)
cuts from the HF weights."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))

pytestmark = pytest.mark.distributed

LAYOUTS = {"tp2": dict(tensor_model_parallel_size=2),
           "pp2_uneven": dict(pipeline_model_parallel_size=2, pipeline_layers=[1, 3])}


def _rank_main(workdir):
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from gloo_rank import model_parallel, a_rank
    from hf_reference import megatron_shard
    from mm_adaptor.models.qwen2_5_vl.config import config_from_hf
    from mm_adaptor.models.qwen2_5_vl.model import model_provider

    with a_rank(workdir) as (case, results):
        for layout, fields in LAYOUTS.items():
            config = config_from_hf(case["config"], **fields)
            with model_parallel(config.tensor_model_parallel_size, config.pipeline_model_parallel_size):
                model = model_provider(config, pre_process=ps.is_pipeline_first_stage(),
                                       post_process=ps.is_pipeline_last_stage())
                request = model.sharded_state_dict(prefix="", metadata={"singleton_local_shards": False})
                loaded = dist_checkpointing.load({"model": request}, os.path.join(workdir, "mc", "iter_0000000"))
                model.load_state_dict(loaded["model"], strict=True)
                tp_rank = ps.get_tensor_model_parallel_rank()
                shard = megatron_shard(case["hf"], model, config, tp_rank, config.tensor_model_parallel_size)
                own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
                results[layout] = {"keys": sorted(own), "expected_keys": sorted(shard),
                                   "differ": [k for k in own
                                              if k in shard and not torch.equal(own[k], shard[k].to(own[k].dtype))]}


@pytest.fixture(scope="module")
def ranks(tiny_hf, tmp_path_factory):
    from mm_adaptor.convert.hf_to_mcore import convert
    from gloo_rank import run_ranks

    hf, saved = tiny_hf
    workdir = tmp_path_factory.mktemp("convert_parallel")
    convert(hf, workdir / "mc", tp=2, llm=[[1, 3]], vit=[[2, 0]])
    return run_ranks(_rank_main, workdir, {"hf": saved, "config": json.loads((hf / "config.json").read_text())})


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resharded_load_equals_the_reference_shards(ranks, layout):
    for rank in ranks:
        result = rank[layout]
        assert result["keys"] == result["expected_keys"]
        assert result["differ"] == []
    if layout == "pp2_uneven":  # the vision tower on the first stage only
        assert any(k.startswith("vision_model.") for k in ranks[0][layout]["keys"])
        assert not any(k.startswith("vision_model.") for k in ranks[1][layout]["keys"])
