"""The converted checkpoint loads through megatron's own dist_checkpointing.load into megatron-core modules of the
same sizes (GPTModel for the language model, a TransformerBlock for the vision layers), local spec, TP1: every
key and shape the modules' sharded_state_dict asks for is there (layer stacks, the swiglu fc1, the norms under
their TE names, the linear layers' _extra_state), and the loaded weights are the rules' tensors."""

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
        assert torch.equal(reader.read(key, layer), expected[f"language_model.decoder.layers.{layer}.mlp.linear_fc1.weight"])
