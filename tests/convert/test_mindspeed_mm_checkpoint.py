"""MindSpeed-MM's Qwen2.5-VL checkpoints (mm-convert's hf_to_mm layout, mm_adaptor.convert.mindspeed_mm) load here:

- written at TP1 PP2, TP2 PP1 and with virtual stages from a seeded tiny transformers model, the reader's whole
  tensors equal what `hf-to-mcore` makes of the same HF weights (torch.equal), and the writer's shards follow
  mm-convert's stated layout (per-group q/k/v rows, gate/up halves per TP rank, layers numbered from 0 per stage);
- broken variants are rejected: global layer numbers on a later stage are refused, HF's q/k/v order is caught;
- the model (TP1) loads a TP2 checkpoint; shapes that contradict the model and missing or malformed layouts are
  refused in one line;
- same weights, same numbers: the driver (2 gloo ranks, PP2 split 2 + 2 while mm-convert wrote 1 + 3) trains from
  the MindSpeed-MM directory and from hf-to-mcore's with identical losses, and `mcore-to-hf` turns both saves into
  identical HF weights."""

import json
import shutil

import pytest
import torch

from mm_adaptor.convert import ConvertError


def _config(hf) -> dict:
    return json.loads((hf / "config.json").read_text())


@pytest.fixture(scope="module")
def expected(tiny_hf):
    from mm_adaptor.convert import family_for, hf_to_mcore_tensors

    hf, saved = tiny_hf
    return hf_to_mcore_tensors(family_for(_config(hf)), saved)


def _differing(got: dict, expected: dict) -> list:
    assert got.keys() == expected.keys(), sorted(got.keys() ^ expected.keys())
    return [name for name, tensor in expected.items() if not torch.equal(got[name], tensor)]


LAYOUTS = {"tp1_pp2": (1, [2, 0], [1, 3]), "tp2_pp1": (2, [2], [4]),
           "tp2_pp2_vpp2": (2, [[1, 0], [1, 0]], [[1, 1], [1, 1]])}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_reader_gives_the_hf_to_mcore_tensors(tiny_hf, expected, tmp_path, layout):
    from mm_adaptor.convert.mindspeed_mm import MMCheckpoint, is_mm_checkpoint
    from mm_adaptor.convert.mindspeed_mm_write import write_mm_checkpoint

    hf, saved = tiny_hf
    tp, vit, llm = LAYOUTS[layout]
    write_mm_checkpoint(saved, _config(hf), tmp_path / "mm", tp, vit, llm)
    assert is_mm_checkpoint(tmp_path / "mm") and not is_mm_checkpoint(hf)
    checkpoint = MMCheckpoint(tmp_path / "mm")
    assert (checkpoint.tp, checkpoint.iteration, checkpoint.totals) == (tp, 0, {"vit": 2, "llm": 4})
    assert _differing(checkpoint.tensors(tied=False), expected) == []


def test_writer_follows_mm_converts_layout(tiny_hf, tmp_path):
    """Facts of mm-convert's hf_to_mm, checked against the HF tensors directly: directory and file layout, layers
    numbered from 0 on each stage, q/k/v rows interleaved per key/value group (per head in the vision tower), the
    gated fc1 split as gate and up halves, row-parallel weights by columns, the Conv3d kernel kept 5-D."""
    from mm_adaptor.convert.mindspeed_mm_write import write_mm_checkpoint

    hf, saved = tiny_hf
    write_mm_checkpoint(saved, _config(hf), tmp_path / "pp", 1, [2, 0], [1, 3])
    assert (tmp_path / "pp" / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert sorted(p.name for p in (tmp_path / "pp" / "release").iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]
    stage1 = torch.load(tmp_path / "pp" / "release" / "mp_rank_00_001" / "model_optim_rng.pt")
    assert sorted(stage1) == ["checkpoint_version", "model"] and stage1["checkpoint_version"] == 3.0
    layers = {int(n.split(".")[3]) for n in stage1["model"] if n.startswith("text_decoder.decoder.layers.")}
    assert layers == {0, 1, 2} and not any(n.startswith("image_encoder.") for n in stage1["model"])
    assert "text_decoder.output_layer.weight" in stage1["model"]

    write_mm_checkpoint(saved, _config(hf), tmp_path / "tp", 2, [2], [4])
    rank0 = torch.load(tmp_path / "tp" / "release" / "mp_rank_00" / "model_optim_rng.pt")["model"]
    attn, blk = "model.layers.1.self_attn.", "visual.blocks.0."
    q, k, v = (saved[f"{attn}{p}_proj.weight"] for p in "qkv")  # 4 heads, 2 groups of head dim 16
    assert torch.equal(rank0["text_decoder.decoder.layers.1.self_attention.linear_qkv.weight"],
                       torch.cat([q[:32], k[:16], v[:16]]))
    gate, up = saved["model.layers.1.mlp.gate_proj.weight"], saved["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(rank0["text_decoder.decoder.layers.1.mlp.linear_fc1.weight"], torch.cat([gate[:48], up[:48]]))
    assert torch.equal(rank0["text_decoder.decoder.layers.1.self_attention.linear_proj.weight"],
                       saved[f"{attn}o_proj.weight"][:, :32])
    vq, vk, vv = saved[f"{blk}attn.qkv.weight"].chunk(3)  # 4 heads of 8
    assert torch.equal(rank0["image_encoder.encoder.blocks.layers.0.self_attention.linear_qkv.weight"],
                       torch.cat([vq[:8], vk[:8], vv[:8], vq[8:16], vk[8:16], vv[8:16]]))
    assert torch.equal(rank0["image_encoder.encoder.patch_embed.proj.weight"], saved["visual.patch_embed.proj.weight"])
    assert torch.equal(rank0["image_encoder.projector.layernorm.weight"], saved["visual.merger.ln_q.weight"])


def test_global_layer_numbers_on_a_later_stage_are_refused(tiny_hf, tmp_path):
    """Broken variant: a writer that keeps global layer numbers (stage 1 holding layers 1, 2, 3)."""
    from mm_adaptor.convert.mindspeed_mm import MMCheckpoint
    from mm_adaptor.convert.mindspeed_mm_write import write_mm_checkpoint

    hf, saved = tiny_hf
    write_mm_checkpoint(saved, _config(hf), tmp_path, 1, [2, 0], [1, 3])
    path = tmp_path / "release" / "mp_rank_00_001" / "model_optim_rng.pt"
    content = torch.load(path)
    prefix = "text_decoder.decoder.layers."
    content["model"] = {(f"{prefix}{int(n.split('.')[3]) + 1}.{n.split('.', 4)[4]}" if n.startswith(prefix) else n): t
                        for n, t in content["model"].items()}
    torch.save(content, path)
    with pytest.raises(ConvertError, match=r"numbers \[1, 2, 3\], expected 0 to 2 \(each pipeline stage numbers"):
        MMCheckpoint(tmp_path)


def test_hf_qkv_order_is_caught(tiny_hf, expected, tmp_path):
    """Broken variant: q, k, v concatenated in HF's order instead of interleaved per group: the comparison of the
    reader's tensors with hf-to-mcore's names exactly the attention projections."""
    from mm_adaptor.convert.mindspeed_mm import MMCheckpoint
    from mm_adaptor.convert.mindspeed_mm_write import write_mm_checkpoint

    hf, saved = tiny_hf
    write_mm_checkpoint(saved, _config(hf), tmp_path, 1, [2], [4])
    path = tmp_path / "release" / "mp_rank_00" / "model_optim_rng.pt"
    content = torch.load(path)
    for layer in range(4):
        for suffix in ("weight", "bias"):
            content["model"][f"text_decoder.decoder.layers.{layer}.self_attention.linear_qkv.{suffix}"] = torch.cat(
                [saved[f"model.layers.{layer}.self_attn.{p}_proj.{suffix}"] for p in "qkv"])
    torch.save(content, path)
    assert _differing(MMCheckpoint(tmp_path).tensors(tied=False), expected) == [
        f"language_model.decoder.layers.{layer}.self_attention.linear_qkv.{suffix}"
        for suffix in ("weight", "bias") for layer in range(4)]


def _model(hf):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from mm_adaptor.models.qwen2_5_vl.config import config_from_hf
    from mm_adaptor.models.qwen2_5_vl.model import model_provider

    model_parallel_cuda_manual_seed(5)
    return model_provider(config_from_hf(_config(hf)))


def test_the_model_loads_a_tp2_checkpoint_and_refuses_a_contradicting_shape(tiny_hf, expected, tmp_path,
                                                                             single_rank_megatron):
    from mm_adaptor.convert.mindspeed_mm import load_mm_checkpoint
    from mm_adaptor.convert.mindspeed_mm_write import write_mm_checkpoint

    hf, saved = tiny_hf
    write_mm_checkpoint(saved, _config(hf), tmp_path / "mm", 2, [2], [4], iteration=7)
    model = _model(hf)
    assert load_mm_checkpoint(tmp_path / "mm", [model]) == 7
    state = {n: t for n, t in model.state_dict().items() if not n.endswith("_extra_state")}
    assert _differing(state, expected) == []

    path = tmp_path / "mm" / "iter_0000007" / "mp_rank_01" / "model_optim_rng.pt"
    content = torch.load(path)
    name = "text_decoder.decoder.layers.2.mlp.linear_fc2.weight"
    content["model"][name] = content["model"][name][:, :40]  # 88 columns joined, the model's 96
    torch.save(content, path)
    with pytest.raises(ConvertError) as refused:
        load_mm_checkpoint(tmp_path / "mm", [_model(hf)])
    assert str(refused.value) == (f"{tmp_path / 'mm'}: {name} has shape (64, 88), the model's "
                                  "language_model.decoder.layers.2.mlp.linear_fc2.weight is (64, 96)")


def test_the_check_before_the_ranks_start_names_the_first_contradiction(tiny_hf, tmp_path):
    """check_mm_checkpoint reads shapes only: the right config passes; a wider MLP, a language or a vision layer
    more are each refused in one line naming the first tensor or the layer counts."""
    from mm_adaptor.convert.mindspeed_mm import check_mm_checkpoint
    from mm_adaptor.convert.mindspeed_mm_write import write_mm_checkpoint

    hf, saved = tiny_hf
    config = _config(hf)
    write_mm_checkpoint(saved, config, tmp_path, 2, [2, 0], [1, 3])
    assert check_mm_checkpoint(tmp_path, config).totals == {"vit": 2, "llm": 4}

    def refused(vision=None, **text) -> str:
        changed = {**config, **text, "text_config": {**config.get("text_config", config), **text},
                   "vision_config": {**config["vision_config"], **(vision or {})}}
        for part in (changed, changed["text_config"]):
            part.pop("layer_types", None)
        with pytest.raises(ConvertError) as error:
            check_mm_checkpoint(tmp_path, changed)
        return str(error.value).removeprefix(f"{tmp_path}: ")

    assert refused(intermediate_size=128) == (
        "text_decoder.decoder.layers.0.mlp.linear_fc1.weight has shape (192, 64), the model's "
        "language_model.decoder.layers.0.mlp.linear_fc1.weight is (256, 64)")
    assert refused(num_hidden_layers=5) == "4 layers under text_decoder.decoder.layers., the model has 5"
    assert refused({"depth": 3}) == "2 layers under image_encoder.encoder.blocks.layers., the model has 3"


def test_missing_or_malformed_layouts_are_refused(tiny_hf, tmp_path):
    from mm_adaptor.convert.mindspeed_mm import MMCheckpoint, is_mm_checkpoint
    from mm_adaptor.convert.mindspeed_mm_write import write_mm_checkpoint

    def refused(path) -> str:
        with pytest.raises(ConvertError) as error:
            MMCheckpoint(path)
        assert "\n" not in str(error.value)
        return str(error.value)

    assert "no latest_checkpointed_iteration.txt" in refused(tmp_path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("last")
    assert "says 'last': expected release or an iteration number" in refused(tmp_path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    assert "names release, which is missing" in refused(tmp_path)
    (tmp_path / "release").mkdir()
    assert "no mp_rank_TT or mp_rank_TT_PPP directories" in refused(tmp_path)
    assert not is_mm_checkpoint(tmp_path)
    hf, saved = tiny_hf
    write_mm_checkpoint(saved, _config(hf), tmp_path / "two", 2, [2, 0], [1, 3])
    shutil.rmtree(tmp_path / "two" / "release" / "mp_rank_01_001")
    assert refused(tmp_path / "two").endswith("mp_rank_01_001/model_optim_rng.pt: missing (the shards are 2 tensor "
                                              "x 2 pipeline ranks)")
    write_mm_checkpoint(saved, _config(hf), tmp_path / "one", 1, [2], [4])
    torch.save({"weights": {}}, tmp_path / "one" / "release" / "mp_rank_00" / "model_optim_rng.pt")
    assert "no 'model' state dict" in refused(tmp_path / "one")


# ---- same weights, same numbers: the driver trains from either directory ----

@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """A tiny HF Qwen2.5-VL (the driver's byte tokenizer ids) as mm-convert writes it at TP1 PP2 (1 + 3 language
    layers) and as hf-to-mcore writes it; the mm directory carries the model's config in hf/ as a converted one does
    (MindSpeed-MM's --mm-model gives it otherwise)."""
    from safetensors.torch import load_file

    from mm_adaptor.convert.hf_to_mcore import convert, copy_side_files
    from mm_adaptor.convert.mindspeed_mm_write import write_mm_checkpoint
    from mm_adaptor.data.shapes import make_shapes
    from mm_adaptor.models.make_tiny_hf import make_tiny_hf

    root = tmp_path_factory.mktemp("mm_vs_mcore")
    make_tiny_hf(str(root / "hf"), "qwen2_5_vl", seed=0)
    saved = {n: t for shard in sorted((root / "hf").glob("*.safetensors")) for n, t in load_file(str(shard)).items()}
    write_mm_checkpoint(saved, _config(root / "hf"), root / "mm", 1, [2, 0], [1, 3])
    copy_side_files(root / "hf", root / "mm" / "hf")
    convert(root / "hf", root / "mcore")
    return root, make_shapes(str(root / "shapes"), count=8, seed=0)


@pytest.mark.distributed
def test_same_weights_same_losses_and_mcore_to_hf_reads_the_saves(both, capsys):
    from mm_adaptor.convert.cli import main
    from mm_adaptor.harness.runner import parse_args, run
    from test_roundtrip import load_dir

    root, shapes = both
    losses = {}
    for source in ("mm", "mcore"):
        dump = run(parse_args(["--model", "qwen2_5_vl", "--load", str(root / source), "--data-path", shapes,
                               "--seq-length", "256", "--lr", "1e-2", "--train-iters", "3", "--timeout", "300",
                               "--pipeline-model-parallel-size", "2", "--pipeline-layers", "2,2",
                               "--save", str(root / f"saved_{source}")]))
        losses[source] = dump.losses
        assert main(["mcore-to-hf", str(root / f"saved_{source}"), str(root / f"back_{source}")]) == 0
    assert len(losses["mm"]) == 3 and losses["mm"] == losses["mcore"], losses
    back_mm, back_mcore, original = (load_dir(root / d) for d in ("back_mm", "back_mcore", "hf"))
    assert back_mm.keys() == original.keys()
    assert all(torch.equal(back_mm[n], back_mcore[n]) for n in original)
    assert not all(torch.equal(back_mm[n], original[n]) for n in original)  # it trained
