"""Experts in the converter, on a test-only MoE family (tiny_moe): `{e}` rules, where each expert sits in the dist
checkpoint, transformers' fused layouts, and megatron's own GPTModel (SequentialMLP) loading what the converter
wrote from each of the three HF forms."""

import pytest
import torch

import tiny_moe


@pytest.fixture
def as_family(monkeypatch):
    """The converter's commands find tiny_moe's family (it is no model registry family)."""
    from mm_adaptor.convert import families

    monkeypatch.setattr(families, "checkpoint_family", tiny_moe.family)
    monkeypatch.setattr(families, "dims_for", tiny_moe.dims)


def test_expert_rules_expand_and_sit_on_a_layer_and_an_expert_axis():
    family = tiny_moe.family({})
    fc1 = [rule for rule in family.rules if rule.mcore.endswith("linear_fc1.weight")]
    assert [rule.expert for rule in fc1] == [0, 1, 2, 3] and family.num_experts == 4
    assert fc1[2].hf == tuple(f"model.layers.{{i}}.mlp.experts.2.{part}.weight" for part in ("gate_proj", "up_proj"))
    assert family.placement(fc1[2], 1) == ("language_model.decoder.layers.mlp.experts.experts.linear_fc1.weight",
                                           (1, 2), (2, 4))
    norm = next(rule for rule in family.rules if "pre_mlp_layernorm" in rule.mcore)
    assert family.placement(norm, 1) == ("language_model.decoder.layers.mlp.linear_fc1.layer_norm_weight", (1,), (2,))
    assert ("language_model.decoder.layers.mlp.experts.experts.linear_fc2._extra_state", (1, 3), (2, 4)) in \
        family.object_placements()
    # a block megatron keys layer by layer: the layer number in the key, the expert axis alone
    apart = tiny_moe.family({"per_layer_keys": ["language_model.decoder.layers."]})
    assert apart.placement(fc1[2], 1) == ("language_model.decoder.layers.1.mlp.experts.experts.linear_fc1.weight",
                                          (2,), (4,))
    assert apart.placement(norm, 1) == ("language_model.decoder.layers.1.mlp.linear_fc1.layer_norm_weight", (), ())


@pytest.mark.parametrize("inner,hidden", [(24, 32), (16, 32)], ids=["plain", "square_gate_up"])
def test_fused_layouts(inner, hidden):
    """4.x keeps each expert as x @ W wants it, 5.x as Linear weights; split inverts fuse. With hidden == 2 * inner
    gate_up is square and both layouts have the same shape: only the version tells them apart."""
    from mm_adaptor.convert.rules import fuse_experts, split_experts

    gen = torch.Generator().manual_seed(0)
    experts = [[torch.randn(inner, hidden, generator=gen), torch.randn(inner, hidden, generator=gen)]
               for _ in range(3)]
    four, five = fuse_experts(experts, 4), fuse_experts(experts, 5)
    assert four.shape == (3, hidden, 2 * inner) and five.shape == (3, 2 * inner, hidden)
    assert torch.equal(four[1], torch.cat(experts[1]).T) and torch.equal(five[1], torch.cat(experts[1]))
    for major, fused in ((4, four), (5, five)):
        assert all(torch.equal(a, b) for got, want in zip(split_experts(fused, 2, major), experts)
                   for a, b in zip(got, want))
    if inner * 2 == hidden:
        assert four.shape == five.shape and not torch.equal(four, five)


def _load_into_megatron(checkpoint):
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1)
    model = tiny_moe.megatron_model()
    request = model.sharded_state_dict(prefix="language_model.", metadata={"singleton_local_shards": False})
    loaded = dist_checkpointing.load({"model": request}, str(checkpoint))["model"]
    result = model.load_state_dict({name.removeprefix("language_model."): t for name, t in loaded.items()})
    assert not result.missing_keys and not result.unexpected_keys
    return {f"language_model.{name}": t for name, t in model.state_dict().items() if not name.endswith("_extra_state")}


@pytest.mark.parametrize("form,version", [("per_expert", "4.57.6"), ("fused_4", "4.57.6"), ("fused_5", "5.24.0")])
def test_megatron_loads_every_form_and_it_comes_back_fused(tmp_path, as_family, single_rank_megatron, form,
                                                          version):
    """The three HF forms give the same checkpoint, which megatron's GPTModel loads (every expert of every layer
    where its sharded_state_dict asks); mcore-to-hf writes the installed transformers' fused layout."""
    from safetensors.torch import load_file

    from mm_adaptor.convert import fuse, hf_to_mcore_tensors, installed_transformers_major
    from mm_adaptor.convert.hf_to_mcore import convert
    from mm_adaptor.convert.mcore_to_hf import convert as back

    per_expert = tiny_moe.per_expert_tensors()
    tiny_moe.save(tmp_path / "hf", tiny_moe.in_form(per_expert, form), version)
    figures = convert(tmp_path / "hf", tmp_path / "mc", ep=2)
    assert figures["tensors"] == 1 + 2 * (7 + 2 * 4) + 2  # per layer: 7 attention, norms and router; 2 per expert
    loaded = _load_into_megatron(tmp_path / "mc" / "iter_0000000")
    expected = hf_to_mcore_tensors(tiny_moe.family({}), per_expert)
    assert sorted(loaded) == sorted(expected)
    assert all(torch.equal(loaded[name], expected[name]) for name in expected)

    back(tmp_path / "mc", tmp_path / "back", max_shard_bytes=20_000)
    written = {}
    for shard in sorted((tmp_path / "back").glob("*.safetensors")):
        written.update(load_file(str(shard)))
    want = fuse(tiny_moe.family({}), per_expert, installed_transformers_major())
    assert sorted(written) == sorted(want)
    assert all(torch.equal(written[name], want[name]) for name in want)


def test_reader_joins_the_experts_megatron_saved_itself(tmp_path, single_rank_megatron):
    """A checkpoint megatron wrote (fc1 of each expert as two swiglu halves): the reader gives each expert of each
    layer whole."""
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from mm_adaptor.convert.mcore_io import Reader

    model_parallel_cuda_manual_seed(2)
    model = tiny_moe.megatron_model()
    (tmp_path / "own").mkdir()
    dist_checkpointing.save(model.sharded_state_dict(prefix="language_model.",
                                                     metadata={"singleton_local_shards": False}),
                            str(tmp_path / "own"))
    reader = Reader(tmp_path / "own")
    key = "language_model.decoder.layers.mlp.experts.experts.linear_fc1.weight"
    assert reader.tensors()[key][0] == (2, 4, 48, 32)
    assert len(reader.meta.state_dict_metadata[key].chunks) == 2 * 4 * 2
    state = model.state_dict()
    for layer in range(2):
        for e in range(4):
            mlp = f"decoder.layers.{layer}.mlp.experts.local_experts.{e}."
            assert torch.equal(reader.read(key, (layer, e)), state[mlp + "linear_fc1.weight"])
            assert torch.equal(reader.read(key.replace("fc1", "fc2"), (layer, e)), state[mlp + "linear_fc2.weight"])
