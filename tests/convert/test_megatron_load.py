"""The converted checkpoint loads through megatron's own dist_checkpointing.load into megatron-core modules of the
same sizes (GPTModel for the language model, a TransformerBlock for the vision layers), local spec, TP1: every
key and shape the modules' sharded_state_dict asks for is there (layer stacks, the swiglu fc1, the norms under
their TE names, the linear layers' _extra_state), and the loaded weights are the rules' tensors."""

import json

import torch


def _config(**kw):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(gated_linear_unit=True, normalization="RMSNorm", use_cpu_initialization=True,
                             add_qkv_bias=True, **kw)


def test_checkpoint_loads_into_megatron_modules(tiny_hf, tmp_path, single_rank_megatron):
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_block import TransformerBlock

    from mm_adaptor.convert import family_for, hf_to_mcore_tensors
    from mm_adaptor.convert.hf_to_mcore import convert
    from tiny import tiny_config

    hf, saved = tiny_hf
    convert(hf, tmp_path / "mc")
    model_parallel_cuda_manual_seed(3)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    gpt = GPTModel(_config(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                           ffn_hidden_size=96, add_bias_linear=False), spec, vocab_size=160, max_sequence_length=64,
                   share_embeddings_and_output_weights=False, position_embedding_type="rope")
    vit = TransformerBlock(_config(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                                   add_bias_linear=True), spec, post_layer_norm=False)
    metadata = {"singleton_local_shards": False}
    request = {"lm": gpt.sharded_state_dict(prefix="language_model.", metadata=metadata),
               "vit": vit.sharded_state_dict(prefix="vision_model.decoder.", metadata=metadata)}
    loaded = dist_checkpointing.load(request, str(tmp_path / "mc" / "iter_0000000"))
    gpt.load_state_dict({n.removeprefix("language_model."): t for n, t in loaded["lm"].items()})
    vit.load_state_dict({n.removeprefix("vision_model.decoder."): t for n, t in loaded["vit"].items()})
    expected = hf_to_mcore_tensors(family_for(tiny_config()), saved)
    got = {f"language_model.{n}": t for n, t in gpt.state_dict().items() if not n.endswith("_extra_state")}
    got.update({f"vision_model.decoder.{n}": t for n, t in vit.state_dict().items() if not n.endswith("_extra_state")})
    assert got.keys() <= expected.keys()
    assert len(got) == len([n for n in expected if n.startswith(("language_model.", "vision_model.decoder."))])
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name].to(tensor.dtype)), name
    # and the reader joins the chunks of a checkpoint megatron itself saved (fc1 as swiglu halves, one per layer)
    from mm_adaptor.convert.mcore_io import Reader

    (tmp_path / "own").mkdir()
    dist_checkpointing.save(gpt.sharded_state_dict(prefix="language_model.", metadata=metadata), str(tmp_path / "own"))
    reader = Reader(tmp_path / "own")
    key = "language_model.decoder.layers.mlp.linear_fc1.weight"
    assert len(reader.meta.state_dict_metadata[key].chunks) == 8
    for layer in range(4):
        assert torch.equal(reader.read(key, layer),
                           expected[f"language_model.decoder.layers.{layer}.mlp.linear_fc1.weight"])


def test_checkpoint_loads_into_the_qwen2_5_vl_model(tiny_hf, tmp_path, single_rank_megatron):
    """The whole model (mm_adaptor.models.qwen2_5_vl, TP1) loads the converted checkpoint through megatron's
    dist_checkpointing with no key left over either way, and holds the rules' tensors."""
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from mm_adaptor.convert import family_for, hf_to_mcore_tensors
    from mm_adaptor.convert.hf_to_mcore import convert
    from mm_adaptor.models.qwen2_5_vl.config import config_from_hf
    from mm_adaptor.models.qwen2_5_vl.model import model_provider

    hf, saved = tiny_hf
    convert(hf, tmp_path / "mc")
    hf_config = json.loads((hf / "config.json").read_text())
    model_parallel_cuda_manual_seed(5)
    model = model_provider(config_from_hf(hf_config))
    request = model.sharded_state_dict(prefix="", metadata={"singleton_local_shards": False})
    loaded = dist_checkpointing.load({"model": request}, str(tmp_path / "mc" / "iter_0000000"))["model"]
    result = model.load_state_dict(loaded, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    expected = hf_to_mcore_tensors(family_for(hf_config), saved)
    state = {name: t for name, t in model.state_dict().items() if not name.endswith("_extra_state")}
    assert sorted(state) == sorted(expected)
    for name, tensor in state.items():
        assert torch.equal(tensor, expected[name].to(tensor.dtype)), name
