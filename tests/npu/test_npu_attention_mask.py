"""--use-flash-attn on the NPU with Megatron's default causal mask: Megatron-LM's data loader hands every layer a
materialised [b, 1, s, s] causal mask; npu_fusion_attention must get the compressed 2048x2048 mask with a causal
sparse mode (2 or 3) instead, recognised without reading the device, and no layer may read the device from the host
(the old per-layer `bool(fully_masked.any())`). Arbitrary masks still go whole (sparse mode 0) with the old numbers.
With --reset-attention-mask its per-document masks run the TND layout on their documents, read once per mask (one
copy to the host per step), not per layer.
The old code (the full mask, a read per layer) is kept here as a broken variant the same checks must reject, and the
FAKE torch_npu refuses what torch_npu documents as giving wrong results (another mask for sparse modes 2 and 3)."""

import pytest

from tests.npu.fake import run_python

pytestmark = pytest.mark.npu

LAYERS, STEPS = 3, 2

SCRIPT = r"""
import argparse, io, json, os, sys, warnings
import torch, torch_npu
sys.path.insert(0, os.getcwd())
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import default_collate
import mm_adaptor
from mm_adaptor import devices
from mm_adaptor.ops import npu_attention
from mm_adaptor.ranks.process import own_rendezvous

LAYERS, STEPS, S, B = __LAYERS__, __STEPS__, 16, 2
HOST_READS = {"aten::_local_scalar_dense", "aten::equal", "aten::nonzero", "aten::is_nonzero", "aten::masked_select",
              "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive", "aten::allclose"}
leaves = torch.utils._pytree.tree_leaves


class HostReads(TorchDispatchMode):
    # every op that hands npu values to the host: .item(), bool(), tolist(), torch.equal, nonzero, .cpu(), boolean
    # indexing; printing (which runs with dispatch modes off) through Tensor.__repr__/__format__ below
    active = []

    def __init__(self):
        super().__init__()
        self.seen = []

    def __enter__(self):
        HostReads.active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        HostReads.active.remove(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        inputs = [a for a in leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        out = func(*args, **kwargs)
        if any(t.device.type == "npu" for t in inputs) and (
                name in HOST_READS
                or (name in ("aten::index", "aten::index_put_", "aten::index_put")
                    and any(t.dtype == torch.bool for t in inputs[1:]))
                or (name == "aten::repeat_interleave" and kwargs.get("output_size") is None and len(args) == 1)
                or (name in ("aten::_to_copy", "aten::copy_")
                    and any(isinstance(o, torch.Tensor) and o.device.type == "cpu" for o in leaves(out)))):
            self.seen.append(name)
        return out


def _printing(method):
    def printed(t, *args):
        if t.device.type == "npu":
            for mode in HostReads.active:
                mode.seen.append(f"Tensor.{method.__name__}")
        return method(t, *args)
    return printed


torch.Tensor.__repr__, torch.Tensor.__format__ = _printing(torch.Tensor.__repr__), _printing(torch.Tensor.__format__)
_tolist = torch.Tensor.tolist


def _listing(t):  # also inside custom ops (mm_adaptor's varlen op), whose kernels run below the dispatch modes
    if t.device.type == "npu":
        for mode in HostReads.active:
            mode.seen.append("Tensor.tolist")
    return _tolist(t)


torch.Tensor.tolist = _listing


def old_fusion_attention(q, k, v, causal, attention_mask, scale, dropout_p):
    # the code before the fix, verbatim in behaviour: a host read per layer
    (sq, b, hq, d), sk = q.shape, k.shape[0]
    kwargs, fully_masked = {}, None
    if causal and attention_mask is None and sq <= sk:
        kwargs = {"atten_mask": npu_attention._causal_mask(q.device), "sparse_mode": 3}
    else:
        masked = npu_attention._full_mask(attention_mask, causal, sq, sk, q.device)
        if masked is not None:
            fully_masked = masked.all(-1, keepdim=True)
            kwargs = {"atten_mask": (masked & ~fully_masked).contiguous(), "sparse_mode": 0}
    out = torch_npu.npu_fusion_attention(
        q.reshape(sq, b, hq * d), k.reshape(sk, b, -1), v.reshape(sk, b, -1), hq, "SBH", scale=scale,
        keep_prob=1.0 - dropout_p, **kwargs)[0].view(sq, b, hq, d)
    if fully_masked is not None and bool(fully_masked.any()):
        group = hq // k.shape[2]
        uniform = v.mean(0, keepdim=True, dtype=torch.float32).repeat_interleave(group, 2).to(out.dtype)
        rows = fully_masked.expand(-1, hq, -1, -1).permute(2, 0, 1, 3)
        out = torch.where(rows, uniform, out)
    return out


calls = []
kernel = torch_npu.npu_fusion_attention


def recording(*args, **kwargs):  # metadata only: reading the mask here would itself be a host read
    calls.append({"sparse_mode": kwargs.get("sparse_mode", 0), "mask": kwargs.get("atten_mask"),
                  "layout": args[4] if len(args) > 4 else kwargs.get("input_layout"),
                  "seq_qlen": kwargs.get("actual_seq_qlen")})
    return kernel(*args, **kwargs)


torch_npu.npu_fusion_attention = recording


def described(recorded):
    compressed = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    out = []
    for c in recorded:
        mask = c["mask"]
        out.append({"sparse_mode": c["sparse_mode"], "shape": None if mask is None else list(mask.shape),
                    "layout": c["layout"], "seq_qlen": c["seq_qlen"],
                    "dtype": None if mask is None else str(mask.dtype),
                    "compressed_causal": mask is not None and tuple(mask.shape) == (2048, 2048)
                    and torch.equal(mask.cpu().bool(), compressed)})
    return out


def batch(reset_attention_mask, device="npu", eods=((5, 10), (7,))):
    # Megatron's GPT dataset code and the default collate, as Megatron-LM's data loader builds the mask
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
    samples = []
    for at in eods:
        tokens = torch.arange(1, S + 1)
        tokens[list(at)] = 0
        mask, _, _ = _get_ltor_masks_and_position_ids(tokens, 0, False, reset_attention_mask, False, True)
        samples.append({"attention_mask": mask})
    return default_collate(samples)["attention_mask"].to(device)


def enable(**options):
    mm_adaptor.disable(keep_device=True)
    mm_adaptor.enable(argparse.Namespace(use_flash_attn=True, **options))


def step(block, x, mask, dy):
    for p in block.parameters():
        p.grad = None
    x = x.detach().requires_grad_()
    y = block(x, mask)
    y.backward(dy)
    return [y.detach(), x.grad, *[p.grad for p in block.parameters()]]  # read on the host after counting


def run(block, masks, seed=0):
    # one warm-up step (where the rule compares the first mask, once), then STEPS steps with fresh masks, counted
    gen = torch.Generator().manual_seed(seed)
    x, dy = (torch.randn(S, B, 32, generator=gen).to(block_device(block)) for _ in range(2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = HostReads()
        with first:
            step(block, x, masks(), dy)
        del calls[:]
        reads = HostReads()
        results = []
        with reads:
            for _ in range(STEPS):
                results.append(step(block, x, masks(), dy))
    results = [[t.cpu() for t in r] for r in results]
    return {"calls": described(calls), "host_reads": reads.seen, "first_step_host_reads": first.seen,
            "results": results, "warnings": [str(w.message) for w in caught if "--use-flash-attn" in str(w.message)]}


def run_packed(block, lengths=(5, 11, 7, 9)):
    # --packing: the block on THD packs (a fresh PackedSeqParams per step, as the driver builds them), counted
    from mm_adaptor.data.packing import packed_seq_params
    gen = torch.Generator().manual_seed(5)
    x, dy = (torch.randn(sum(lengths), 1, 32, generator=gen).to("npu") for _ in range(2))

    def packed_step():
        for p in block.parameters():
            p.grad = None
        y = block(x.detach().requires_grad_(), None, packed_seq_params=packed_seq_params(list(lengths), device="npu"))
        y.backward(dy)

    first = HostReads()
    with first:
        packed_step()
    del calls[:]
    reads = HostReads()
    with reads:
        for _ in range(STEPS):
            packed_step()
    return {"calls": described(calls), "host_reads": reads.seen}


def run_vision(core):
    gen = torch.Generator().manual_seed(6)
    q, k, v, dy = (torch.randn(12, 1, 4, 8, generator=gen).to("npu") for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    del calls[:]
    reads = HostReads()
    with reads:
        core(q, k, v, torch.tensor([0, 5, 12], dtype=torch.int32)).backward(dy.reshape(12, 1, 32))
    return {"calls": described(calls), "host_reads": reads.seen}


def block_device(block):
    return next(block.parameters()).device


def same(a, b):
    return all(torch.equal(x, y) for ra, rb in zip(a["results"], b["results"]) for x, y in zip(ra, rb))


def close(a, b):
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-5) for ra, rb in zip(a["results"], b["results"])
               for x, y in zip(ra, rb))


t = torch.tensor([1.0, 0.0, 2.0], device="npu")
READS = {"item": lambda: t[0].item(), "bool": lambda: bool(t[0]), "if": lambda: 1 if t.any() else 0,
         "float": lambda: float(t[0]), "tolist": lambda: t.tolist(), "cpu": lambda: t.cpu(),
         "print": lambda: print(t, file=io.StringIO()), "format": lambda: f"{t}",
         "equal": lambda: torch.equal(t, t), "allclose": lambda: torch.allclose(t, t), "nonzero": lambda: t.nonzero(),
         "boolean_index": lambda: t[t > 0], "where_one_argument": lambda: torch.where(t > 0),
         "repeat_interleave_by_tensor": lambda: t.repeat_interleave(t.long())}
NOT_READS = {"arithmetic": lambda: t * 2, "where": lambda: torch.where(t > 0, t, -t), "any": lambda: t.any(),
             "repeat_interleave_by_int": lambda: t.repeat_interleave(2)}
instrument = {}
for name, read in {**READS, **NOT_READS}.items():
    probe = HostReads()
    with probe:
        read()
    instrument[name] = bool(probe.seen)


with own_rendezvous():
    devices.install("npu")
    dist.init_process_group("hccl", rank=0, world_size=1)
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlock
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
                            bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False)
    block = TransformerBlock(cfg, get_gpt_layer_local_spec()).to("npu")
    causal = lambda: batch(False)
    documents = lambda: batch(True)
    out = {"instrument": instrument, "reads": list(READS)}

    enable(reset_attention_mask=False)  # Megatron-LM's arguments: the data loader's masks are causal
    fixed = out["fixed"] = run(block, causal)
    enable(reset_attention_mask=False)  # a fresh rule: a script of its own passes per-document masks
    documents_on_causal_config = out["documents_on_causal_config"] = run(block, documents)
    enable()  # options without reset_attention_mask (a script of its own): every mask goes whole
    arbitrary = out["arbitrary"] = run(block, documents)
    causal_whole = run(block, causal)
    out["fixed_equals_whole_mask"] = same(fixed, causal_whole)
    out["documents_on_causal_config_equals_whole"] = same(documents_on_causal_config, arbitrary)
    enable(reset_attention_mask=True)  # Megatron-LM's per-document masks: the TND layout on their documents
    per_document = out["per_document"] = run(block, documents)
    out["per_document_close_to_whole"] = close(per_document, arbitrary)

    # --packing's attention on the npu: the TND kernel per layer, each pack's bounds read once, not per layer; the
    # old code (the device's bounds handed to the kernel, read per layer and pass) as the broken variant
    mm_adaptor.disable(keep_device=True)
    from mm_adaptor.patches.transformer import packed_attention
    packing = packed_attention.patch_set()
    packing.apply()
    out["packed"] = run_packed(block)
    host_bounds = packed_attention.HOST_BOUNDS.of
    packed_attention.HOST_BOUNDS.of = lambda packed, cu_q, cu_kv: (cu_q, cu_kv)
    out["packed_reading_per_layer"] = run_packed(block)
    packed_attention.HOST_BOUNDS.of = host_bounds
    packing.revert()

    # the vision tower's core attention: its segments come as a host tensor and stay there for the TND kernel;
    # the old code (a device copy per layer, read back by the kernel) as the broken variant
    from mm_adaptor.models.qwen2_5_vl import vision
    out["vision"] = run_vision(vision.VarlenCoreAttention(cfg, 1, None, "self"))
    kernel_bounds = vision.bounds_for_kernel
    vision.bounds_for_kernel = lambda cu, device: cu.to(device)
    out["vision_reading_per_layer"] = run_vision(vision.VarlenCoreAttention(cfg, 1, None, "self"))
    vision.bounds_for_kernel = kernel_bounds

    # the old code: its op (a host read per layer) and its patch (no rule: the default causal mask goes whole)
    npu_attention.fusion_attention, new_op = old_fusion_attention, npu_attention.fusion_attention
    enable()
    old = out["old"] = run(block, causal)
    old_arbitrary = run(block, documents)
    npu_attention.fusion_attention = new_op
    out["arbitrary_equals_old"] = same(arbitrary, old_arbitrary)
    out["fixed_equals_old"] = same(fixed, old)

    # the op alone, a fully masked row among arbitrary ones: the old numbers, forward and backward, no host read
    gen = torch.Generator().manual_seed(3)
    q, k, v, dy = (torch.randn(6, 2, 4, 8, generator=gen).to("npu") for _ in range(4))
    rows = torch.rand(2, 1, 6, 6, generator=gen) < 0.4
    rows[0, :, 2, :] = True
    rows = rows.to("npu")
    op_results = {}
    for name, op in (("new", new_op), ("old", old_fusion_attention)):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        reads = HostReads()
        with reads:
            y = op(qq, kk, vv, False, rows, 0.3, 0.0)
            y.backward(dy)
        op_results[name] = ([t.detach().cpu() for t in (y, qq.grad, kk.grad, vv.grad)], reads.seen)
    out["op_fully_masked_row_equals_old"] = all(
        torch.equal(a, b) for a, b in zip(op_results["new"][0], op_results["old"][0]))
    out["op_host_reads"] = {name: r[1] for name, r in op_results.items()}

    # the CPU backend's numbers: the rule on (is_causal) and off (the mask) agree bit for bit
    cpu_block = block.to("cpu")  # the npu runs are done
    cpu_causal = lambda: batch(False, device="cpu")
    enable(reset_attention_mask=False)
    cpu_rule = run(cpu_block, cpu_causal)
    enable()
    out["cpu_rule_equals_mask"] = same(cpu_rule, run(cpu_block, cpu_causal))
    mm_adaptor.disable(keep_device=True)
    for r in (fixed, documents_on_causal_config, arbitrary, per_document, old):
        del r["results"]
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
print("RESULT=" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def runs():
    return run_python(SCRIPT.replace("__LAYERS__", str(LAYERS)).replace("__STEPS__", str(STEPS)), devices=1)


def assert_compressed_causal(run):
    calls = run["calls"]
    assert len(calls) == LAYERS * STEPS, calls  # forward only: the autograd calls npu_fusion_attention_grad
    for call in calls:
        assert call["sparse_mode"] in (2, 3) and call["compressed_causal"], call
        assert call["shape"] == [2048, 2048] and call["dtype"] == "torch.bool", call


def assert_whole(run):
    calls = run["calls"]
    assert len(calls) == LAYERS * STEPS, calls
    for call in calls:
        assert call["sparse_mode"] == 0 and call["shape"] == [2, 1, 16, 16], call


def assert_no_host_read(run):
    assert run["host_reads"] == [], run["host_reads"]


def test_default_causal_mask_runs_the_kernels_causal_mode_with_the_compressed_mask(runs):
    fixed = runs["fixed"]
    assert_compressed_causal(fixed)
    assert fixed["warnings"] == []
    assert runs["fixed_equals_whole_mask"] and runs["fixed_equals_old"]  # the same numbers as the mask given whole


def test_no_layer_reads_the_device_from_the_host(runs):
    for name in ("fixed", "arbitrary", "documents_on_causal_config"):
        assert_no_host_read(runs[name])
    assert runs["op_host_reads"]["new"] == []
    # the rule's one comparison, with the first mask of a run; none for masks that go whole
    assert runs["fixed"]["first_step_host_reads"] == ["aten::equal"]
    assert runs["documents_on_causal_config"]["first_step_host_reads"] == ["aten::equal"]
    assert runs["arbitrary"]["first_step_host_reads"] == []


def test_per_document_masks_run_the_tnd_layout_read_once_per_mask(runs):
    """--reset-attention-mask: each step's fresh mask is read once (its documents, one copy to the host), its
    layers then run npu_fusion_attention's TND layout on the documents with the causal sparse mode, and the numbers
    are the whole mask's within the kernels' rounding."""
    run = runs["per_document"]
    assert run["host_reads"] == ["aten::_to_copy"] * STEPS, run["host_reads"]
    assert len(run["calls"]) == LAYERS * STEPS, run["calls"]
    for call in run["calls"]:  # rows (5, 10) and (7,) of 16 tokens: documents 6, 5, 5 and 8, 8
        assert call["layout"] == "TND" and call["seq_qlen"] == [6, 11, 16, 24, 32], call
        assert call["sparse_mode"] == 3 and call["compressed_causal"], call
    assert run["warnings"] == []
    assert runs["per_document_close_to_whole"]


def test_arbitrary_masks_go_whole_with_the_old_numbers(runs):
    assert_whole(runs["arbitrary"])  # per-document masks from a script of its own
    assert runs["arbitrary_equals_old"]
    assert runs["op_fully_masked_row_equals_old"]  # uniform rows, now selected on the device


def test_a_non_causal_mask_under_the_causal_configuration_goes_whole_with_one_warning(runs):
    """The rule trusts the configuration, checked against the first mask once (in the warm-up step)."""
    run = runs["documents_on_causal_config"]
    assert_whole(run)
    assert len(run["warnings"]) == 1 and "not Megatron's default causal mask" in run["warnings"][0], run["warnings"]
    assert runs["documents_on_causal_config_equals_whole"]


def test_the_cpu_backend_gives_the_same_numbers_with_the_rule(runs):
    assert runs["cpu_rule_equals_mask"]


def test_the_host_read_counter_sees_every_way_of_reading_the_device(runs):
    seen = runs["instrument"]
    assert all(seen[name] for name in runs["reads"]), seen
    assert not any(seen[name] for name in set(seen) - set(runs["reads"])), seen


def test_the_old_code_fails_these_checks(runs):
    old = runs["old"]
    with pytest.raises(AssertionError):
        assert_compressed_causal(old)
    with pytest.raises(AssertionError):
        assert_no_host_read(old)
    assert old["host_reads"].count("aten::_local_scalar_dense") == LAYERS * STEPS  # one read per layer
    assert runs["op_host_reads"]["old"] == ["aten::_local_scalar_dense"]


FAKE_RULES = r"""
import json, torch, torch_npu

q = torch.randn(6, 2, 16, device="npu")
full = torch.ones(6, 6, dtype=torch.bool, device="npu").triu(1)
compressed = torch.ones(2048, 2048, dtype=torch.bool, device="npu").triu(1)
cases = {
    "sparse3_compressed": dict(atten_mask=compressed, sparse_mode=3),
    "sparse2_compressed": dict(atten_mask=compressed, sparse_mode=2),
    "sparse3_full_mask": dict(atten_mask=full, sparse_mode=3),
    "sparse2_full_mask": dict(atten_mask=full.view(1, 1, 6, 6), sparse_mode=2),
    "sparse3_lower_triangle": dict(atten_mask=compressed.t().contiguous(), sparse_mode=3),
    "sparse3_on_host": dict(atten_mask=compressed.cpu(), sparse_mode=3),
    "sparse0_full_mask": dict(atten_mask=full, sparse_mode=0),
    "sparse0_tokens_with_their_mask": dict(atten_mask=full, sparse_mode=0, next_tockens=0),
    "sparse0_tokens_without_their_mask": dict(atten_mask=torch.zeros_like(full), sparse_mode=0, next_tockens=0),
    "sparse0_negative_next_beyond_pre": dict(atten_mask=torch.ones_like(full), sparse_mode=0, pre_tockens=1,
                                             next_tockens=-2),
}
out = {}
for name, kwargs in cases.items():
    try:
        torch_npu.npu_fusion_attention(q, q, q, 2, "SBH", **kwargs)
        out[name] = "ok"
    except RuntimeError as error:
        out[name] = str(error)
print("RESULT=" + json.dumps(out))
"""


def test_the_fake_refuses_masks_that_torch_npu_documents_as_giving_wrong_results():
    r = run_python(FAKE_RULES, devices=1)
    for ok in ("sparse3_compressed", "sparse2_compressed", "sparse0_full_mask", "sparse0_tokens_with_their_mask"):
        assert r[ok] == "ok", (ok, r[ok])
    for name in ("sparse3_full_mask", "sparse2_full_mask"):
        assert "takes the compressed 2048x2048 mask" in r[name], r[name]
    assert "triu(ones(2048, 2048), 1)" in r["sparse3_lower_triangle"]
    assert "atten_mask on cpu" in r["sparse3_on_host"]
    assert "masks what they exclude" in r["sparse0_tokens_without_their_mask"]
    assert "needs pre_tockens >= 2" in r["sparse0_negative_next_beyond_pre"]


def test_packed_attention_reads_each_packs_bounds_once(runs):
    """--packing on the npu: every layer runs npu_fusion_attention's TND layout on the pack's samples, and the
    bounds come to the host once per pack (one copy), not from the device in every layer's forward and backward
    (the old code, which the same check rejects)."""
    run = runs["packed"]
    assert run["host_reads"] == ["aten::_to_copy"] * STEPS, run["host_reads"]
    assert len(run["calls"]) == LAYERS * STEPS, run["calls"]
    for call in run["calls"]:
        assert call["layout"] == "TND" and call["seq_qlen"] == [5, 16, 23, 32], call
        assert call["sparse_mode"] == 3 and call["compressed_causal"], call
    old = runs["packed_reading_per_layer"]
    assert len(old["calls"]) == LAYERS * STEPS and len(old["host_reads"]) >= 2 * LAYERS * STEPS, old["host_reads"]


def test_the_vision_towers_segments_stay_on_the_host(runs):
    run = runs["vision"]
    assert run["host_reads"] == [], run["host_reads"]
    assert [(c["layout"], c["seq_qlen"], c["sparse_mode"]) for c in run["calls"]] == [("TND", [5, 12], 0)], run
    assert len(runs["vision_reading_per_layer"]["host_reads"]) >= 2, runs["vision_reading_per_layer"]
