"""FAKE torch_npu npu_fusion_attention and npu_fusion_attention_grad (tests only): torch_npu's schemas, the argument
rules its documentation states and the autograd wiring its derivatives.yaml declares, computed by reference math in
float32 over the whole score matrix. NOT Ascend's FlashAttentionScore kernel: no tiling, no speed, other roundings.

Source (read for the facts, nothing copied): Ascend/op-plugin at commit 517f2e7d (2026-08-21):
op_plugin/config/op_plugin_functions.yaml and derivatives.yaml, docs/zh/custom_APIs/torch_npu/
torch_npu-npu_fusion_attention.md, op_plugin/ops/opapi/FlashAttentionKernelNpuOpApi.cpp. Implemented: layouts BSH,
SBH, BSND, BNSD, and TND (varlen, below), GQA (Nq a multiple of Nkv),
atten_mask (bool/uint8, 1 = masked out; SS, 11SS, B1SS or BNSS; on the query's device), sparse_mode 0 (with
pre_tockens/next_tockens), 1, 2 (leftUpCausal) and 3 (rightDownCausal), scale, keep_prob (the dropout mask drawn
from the fake npu generator through a seed, regenerated in backward). Enforced as documented, where the kernel would
compute wrong results instead of refusing: sparse modes 2 and 3 take exactly the compressed causal mask
triu(ones(2048, 2048), 1), never the full one; in sparse mode 0 atten_mask masks whatever pre_tockens/next_tockens
exclude, and a negative one of those needs the other at least its size (below Skv, resp. Sq). Refused: pse,
padding_mask, prefix, sink, dropout_mask, sparse modes 4 to 8 outside TND.

TND: query [T, N, D], key/value [T, Nkv, D(v)]; actual_seq_qlen/actual_seq_kvlen are required, of one size (1 to
1024 entries), cumulative without a leading 0, ending at each T (1 to 1M) (the FAKE does not implement trailing
zeros); sparse modes 0 without a mask, 2 and 3 (the compressed causal mask, per segment), 4 (band: keys from
i + sk - sq - pre_tockens to i + sk - sq + next_tockens, the same compressed mask); no row may be fully masked (the
documented "no all-1 row" rule of the varlen case); no dropout in the FAKE. softmax_max and softmax_sum are
[T, N, 8] (what the plugin allocates for TND). Its backward takes D = rowsum(dy * attention_in), the forward output
that derivatives.yaml hands it (result0).
"""

from __future__ import annotations

import torch

from torch_npu.fused_ops import FLOATS, _check, _count

SCHEMAS = {
    "npu_fusion_attention": (
        "npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, "
        "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., float keep_prob=1., "
        "int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, int[]? prefix=None, "
        "int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, "
        "bool sync=False, str softmax_layout=\"\", Tensor? sink=None, Tensor? dropout_mask=None, int seed=0, "
        "int offset=0) -> (Tensor, Tensor, Tensor, Tensor, int, int, int)"),
    "npu_fusion_attention_grad": (
        "npu_fusion_attention_grad(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, "
        "str input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
        "Tensor? softmax_max=None, Tensor? softmax_sum=None, Tensor? softmax_in=None, Tensor? attention_in=None, "
        "float scale_value=1., float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, "
        "int inner_precise=0, int seed=0, int offset=0, int numels=0, int[]? prefix=None, "
        "int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, "
        "bool sync=False, str softmax_layout=\"\", Tensor? sink=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"),
}
LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
TND_MAX_SEGMENTS = 1024
TND_MAX_TOKENS = 1 << 20
TND_SPARSE_MODES = (0, 2, 3, 4)
COMPRESSED_MASK = 2048  # sparse modes 2 and 3 take this triu(ones(2048, 2048), 1) mask instead of the full one
MASKED = -1e30
_COMPRESSED: dict = {}


def _to_bnsd(t, layout, heads):
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":
        b, s, h = t.shape
        return t.view(b, s, heads, h // heads).transpose(1, 2)
    s, b, h = t.shape  # SBH
    return t.view(s, b, heads, h // heads).permute(1, 2, 0, 3)


def _from_bnsd(t, layout):
    b, n, s, d = t.shape
    if layout == "BNSD":
        return t.contiguous()
    if layout == "BSND":
        return t.transpose(1, 2).contiguous()
    if layout == "BSH":
        return t.transpose(1, 2).reshape(b, s, n * d)
    return t.permute(2, 0, 1, 3).reshape(s, b, n * d)


def _heads(q, k, head_num, layout):
    _check(layout in LAYOUTS, f"npu_fusion_attention: input_layout {layout!r} (the FAKE takes {LAYOUTS})")
    _check(q.dtype in FLOATS and k.dtype == q.dtype, f"npu_fusion_attention: dtypes {q.dtype}, {k.dtype}")
    if layout in ("BSH", "SBH"):
        _check(q.dim() == 3 and q.shape[-1] % head_num == 0, f"npu_fusion_attention: {layout} query {q.shape}")
        d = q.shape[-1] // head_num
        _check(k.shape[-1] % d == 0, "npu_fusion_attention: key's H is not a multiple of the head dim")
        n_kv = k.shape[-1] // d
    else:
        _check(q.dim() == 4, f"npu_fusion_attention: {layout} query {q.shape}")
        n_kv = k.shape[1] if layout == "BNSD" else k.shape[2]
        _check((q.shape[1] if layout == "BNSD" else q.shape[2]) == head_num, "npu_fusion_attention: head_num")
        d = q.shape[-1]
    _check(1 <= head_num <= 256 and head_num % n_kv == 0, f"npu_fusion_attention: Nq={head_num}, Nkv={n_kv}")
    _check(1 <= d <= 768, f"npu_fusion_attention: head dim {d} (1 to 768)")
    return n_kv


def _compressed_causal(device) -> torch.Tensor:
    mask = _COMPRESSED.get(device)
    if mask is None:
        mask = _COMPRESSED[device] = torch.ones(COMPRESSED_MASK, COMPRESSED_MASK, dtype=torch.bool,
                                                device=device).triu(1)
    return mask


def _check_tokens(pre, nxt, sq, sk):
    _check(nxt >= 0 or (pre >= -nxt and -nxt < sk),
           f"npu_fusion_attention: next_tockens {nxt} < 0 needs pre_tockens >= {-nxt} and |next_tockens| < Skv {sk}")
    _check(pre >= 0 or (nxt >= -pre and -pre < sq),
           f"npu_fusion_attention: pre_tockens {pre} < 0 needs next_tockens >= {-pre} and |pre_tockens| < Sq {sq}")


def _masked(atten_mask, sparse_mode, pre, nxt, b, n, sq, sk, device):
    """Boolean [b|1, n|1, sq, sk] (True = masked out) or None: what the kernel computes for these arguments."""
    if atten_mask is None:
        return None  # the documentation: without atten_mask, sparse_mode and the tokens have no effect
    _check(atten_mask.dtype in (torch.bool, torch.uint8), f"npu_fusion_attention: atten_mask {atten_mask.dtype}")
    _check(atten_mask.device == device, f"npu_fusion_attention: atten_mask on {atten_mask.device}, query on {device}")
    rows = torch.arange(sq, device=device).unsqueeze(-1)
    cols = torch.arange(sk, device=device)
    if sparse_mode in (2, 3):
        _check(tuple(atten_mask.shape) == (COMPRESSED_MASK, COMPRESSED_MASK),
               f"npu_fusion_attention: sparse_mode {sparse_mode} takes the compressed 2048x2048 mask, not "
               f"{tuple(atten_mask.shape)}")
        _check(torch.equal(atten_mask.to(torch.bool), _compressed_causal(device)),
               f"npu_fusion_attention: sparse_mode {sparse_mode} takes triu(ones(2048, 2048), 1) as atten_mask "
               "(1 = masked out); any other mask gives wrong results on the kernel")
        return (cols > rows + (sk - sq if sparse_mode == 3 else 0)).view(1, 1, sq, sk)
    _check(sparse_mode in (0, 1), f"npu_fusion_attention: sparse_mode {sparse_mode} (the FAKE takes 0 to 3)")
    shape = tuple(atten_mask.shape)
    _check(shape[-2:] == (sq, sk) and len(shape) in (2, 4)
           and (len(shape) == 2 or (shape[0] in (1, b) and shape[1] in (1, n))),
           f"npu_fusion_attention: atten_mask {shape} is not SS, 11SS, B1SS or BNSS for b={b} n={n} {sq}x{sk}")
    masked = atten_mask.to(torch.bool).view(*([1, 1] if len(shape) == 2 else []), *shape)
    if sparse_mode == 0 and (pre < sq or nxt < sk):  # the tokens exclude some keys: the mask must exclude them too
        _check_tokens(pre, nxt, sq, sk)
        outside = (cols > rows + nxt) | (cols < rows - pre)
        _check(not bool((outside & ~masked).any()),
               f"npu_fusion_attention: sparse_mode 0 with pre_tockens {pre}, next_tockens {nxt} needs an atten_mask "
               "that masks what they exclude")
        masked = masked | outside
    return masked


def _keep(seed, offset, keep_prob, shape, device):
    generator = torch.Generator().manual_seed(seed + offset)
    return (torch.rand(shape, generator=generator) < keep_prob).to(device)


def _refuse(**unsupported):
    for name, value in unsupported.items():
        _check(value is None or value == [], f"npu_fusion_attention: the FAKE does not implement {name}")


def _scores(q, k, v, head_num, layout, atten_mask, scale, pre, nxt, sparse_mode):
    n_kv = _heads(q, k, head_num, layout)
    qb, kb, vb = _to_bnsd(q, layout, head_num).float(), _to_bnsd(k, layout, n_kv).float(), \
        _to_bnsd(v, layout, n_kv).float()
    kb, vb = kb.repeat_interleave(head_num // n_kv, 1), vb.repeat_interleave(head_num // n_kv, 1)
    b, n, sq, _ = qb.shape
    masked = _masked(atten_mask, sparse_mode, pre, nxt, b, n, sq, kb.shape[2], q.device)
    scores = (qb @ kb.transpose(-1, -2)) * scale
    if masked is not None:
        scores = scores.masked_fill(masked, MASKED)
    return qb, kb, vb, scores, masked, n_kv


def fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                     scale=1.0, keep_prob=1.0, pre_tockens=2147483647, next_tockens=2147483647, inner_precise=0,
                     prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                     sync=False, softmax_layout="", sink=None, dropout_mask=None, seed=0, offset=0):
    _count("npu_fusion_attention")
    _refuse(pse=pse, padding_mask=padding_mask, prefix=prefix, sink=sink, dropout_mask=dropout_mask)
    _check(0 < keep_prob <= 1, f"npu_fusion_attention: keep_prob {keep_prob} outside (0, 1]")
    if input_layout == "TND":
        _check(keep_prob == 1, "npu_fusion_attention: the FAKE does not implement dropout in the TND layout")
        return _tnd_forward(query, key, value, head_num, atten_mask, scale, pre_tockens, next_tockens,
                            actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout)
    _refuse(actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen)
    qb, kb, vb, scores, _, _ = _scores(query, key, value, head_num, input_layout, atten_mask, scale, pre_tockens,
                                       next_tockens, sparse_mode)
    row_max = scores.amax(-1, keepdim=True)
    exp = torch.exp(scores - row_max)
    row_sum = exp.sum(-1, keepdim=True)
    probs = exp / row_sum
    numels = 0
    if keep_prob < 1:
        if seed == 0:  # the kernel's Philox seed comes from the device generator (megatron's RNG tracker sets it)
            seed = int(torch.randint(1 << 62, (1,), device=query.device).item())
        numels = probs.numel()
        probs = probs * _keep(seed, offset, keep_prob, probs.shape, query.device) / keep_prob
    out = _from_bnsd(probs @ vb, input_layout).to(query.dtype)
    widen = (*row_max.shape[:-1], 8)  # softmax_max and softmax_sum: [B, N, Sq, 8] float32
    return (out, row_max.expand(widen).contiguous(), row_sum.expand(widen).contiguous(), query.new_empty(0),
            int(seed), int(offset), int(numels))


def fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                          atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None, attention_in=None,
                          scale_value=1.0, keep_prob=1.0, pre_tockens=2147483647, next_tockens=2147483647,
                          inner_precise=0, seed=0, offset=0, numels=0, prefix=None, actual_seq_qlen=None,
                          actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False, softmax_layout="",
                          sink=None):
    _count("npu_fusion_attention_grad")
    _refuse(pse=pse, padding_mask=padding_mask, prefix=prefix, sink=sink)
    _check(softmax_max is not None and softmax_sum is not None, "npu_fusion_attention_grad: softmax_max/sum")
    if input_layout == "TND":
        _check(keep_prob == 1, "npu_fusion_attention_grad: the FAKE does not implement dropout in the TND layout")
        return _tnd_backward(query, key, value, dy, head_num, atten_mask, softmax_max, softmax_sum, attention_in,
                             scale_value, pre_tockens, next_tockens, actual_seq_qlen, actual_seq_kvlen, sparse_mode)
    _refuse(actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen)
    qb, kb, vb, scores, masked, n_kv = _scores(query, key, value, head_num, input_layout, atten_mask, scale_value,
                                               pre_tockens, next_tockens, sparse_mode)
    probs = torch.exp(scores - softmax_max[..., :1]) / softmax_sum[..., :1]
    dout = _to_bnsd(dy, input_layout, head_num).float()
    d_kept = dout @ vb.transpose(-1, -2)
    kept = probs
    if keep_prob < 1:
        keep = _keep(seed, offset, keep_prob, probs.shape, query.device) / keep_prob
        kept, d_kept = probs * keep, d_kept * keep
    dv = kept.transpose(-1, -2) @ dout
    d_scores = probs * (d_kept - (d_kept * probs).sum(-1, keepdim=True))
    if masked is not None:
        d_scores = d_scores.masked_fill(masked, 0.0)
    dq = (d_scores @ kb) * scale_value
    dk = (d_scores.transpose(-1, -2) @ qb) * scale_value
    group = head_num // n_kv
    if group > 1:
        b, _, sk, _ = dk.shape
        dk, dv = dk.view(b, n_kv, group, sk, -1).sum(2), dv.view(b, n_kv, group, sk, -1).sum(2)
    dq, dk, dv = (_from_bnsd(g, input_layout).to(t.dtype) for g, t in ((dq, query), (dk, key), (dv, value)))
    return dq, dk, dv, query.new_empty(0), query.new_empty(0)


def _meta(query, key, value, head_num, input_layout, *args, **kwargs):
    if input_layout == "TND":
        stats = query.new_empty((query.shape[0], query.shape[1], 8), dtype=torch.float32)
        return (query.new_empty((*query.shape[:2], value.shape[-1])), stats, stats.clone(), query.new_empty(0), 0, 0,
                0)
    n_kv = _heads(query, key, head_num, input_layout)
    qb = _to_bnsd(query, input_layout, head_num)
    vb = _to_bnsd(value, input_layout, n_kv)
    b, n, sq, _ = qb.shape
    out_shape = _from_bnsd(qb.new_empty((b, n, sq, vb.shape[-1])), input_layout).shape
    stats = query.new_empty((b, n, sq, 8), dtype=torch.float32)
    return query.new_empty(out_shape), stats, stats.clone(), query.new_empty(0), 0, 0, 0


def _grad_meta(query, key, value, dy, head_num, input_layout, **kwargs):
    return (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), query.new_empty(0),
            query.new_empty(0))


_ARGS = ("query", "key", "value", "head_num", "input_layout", "pse", "padding_mask", "atten_mask", "scale",
         "keep_prob", "pre_tockens", "next_tockens", "inner_precise", "prefix", "actual_seq_qlen", "actual_seq_kvlen",
         "sparse_mode", "gen_mask_parallel", "sync", "softmax_layout", "sink", "dropout_mask", "seed", "offset")


def _setup(ctx, inputs, output):
    a = dict(zip(_ARGS, inputs))
    ctx.save_for_backward(a["query"], a["key"], a["value"], a["atten_mask"], output[1], output[2], output[0])
    ctx.args = {k: v for k, v in a.items() if k not in ("query", "key", "value", "atten_mask", "dropout_mask")}
    ctx.seed, ctx.offset, ctx.numels = output[4], output[5], output[6]


def _autograd(ctx, grad, *_unused):
    q, k, v, atten_mask, softmax_max, softmax_sum, out = ctx.saved_tensors
    a = ctx.args
    dq, dk, dv, _, _ = torch.ops.npu.npu_fusion_attention_grad(
        q, k, v, grad, a["head_num"], a["input_layout"], atten_mask=atten_mask, softmax_max=softmax_max,
        softmax_sum=softmax_sum, attention_in=out, scale_value=a["scale"], keep_prob=a["keep_prob"],
        pre_tockens=a["pre_tockens"], next_tockens=a["next_tockens"], inner_precise=a["inner_precise"], seed=ctx.seed,
        offset=ctx.offset, numels=ctx.numels, actual_seq_qlen=a["actual_seq_qlen"],
        actual_seq_kvlen=a["actual_seq_kvlen"], sparse_mode=a["sparse_mode"])
    return (dq, dk, dv, *([None] * (len(_ARGS) - 3)))


def _tnd_segments(query, key, value, head_num, actual_seq_qlen, actual_seq_kvlen):
    """(q0, q1, k0, k1) per segment, after the TND rules on shapes and lengths."""
    _check(query.dim() == 3 and key.dim() == 3 and value.dim() == 3, "npu_fusion_attention: TND takes [T, N, D]")
    _check(query.dtype in FLOATS and key.dtype == query.dtype and value.dtype == query.dtype,
           f"npu_fusion_attention: dtypes {query.dtype}, {key.dtype}, {value.dtype}")
    n, n_kv = query.shape[1], key.shape[1]
    _check(n == head_num and 1 <= n <= 256 and n % n_kv == 0 and value.shape[1] == n_kv,
           f"npu_fusion_attention: head_num {head_num}, Nq={n}, Nkv={n_kv}")
    _check(1 <= query.shape[2] == key.shape[2] <= 768 and value.shape[2] <= key.shape[2],
           f"npu_fusion_attention: head dims q {query.shape[2]}, k {key.shape[2]}, v {value.shape[2]} (1 to 768, "
           "Dq = Dk >= Dv)")
    _check(bool(actual_seq_qlen) and bool(actual_seq_kvlen) and len(actual_seq_qlen) == len(actual_seq_kvlen),
           "npu_fusion_attention: TND needs actual_seq_qlen and actual_seq_kvlen of one size, not empty")
    _check(len(actual_seq_qlen) <= TND_MAX_SEGMENTS,
           f"npu_fusion_attention: {len(actual_seq_qlen)} segments (at most {TND_MAX_SEGMENTS} in TND)")
    bounds = []
    for name, seq, total in (("actual_seq_qlen", actual_seq_qlen, query.shape[0]),
                             ("actual_seq_kvlen", actual_seq_kvlen, key.shape[0])):
        _check(1 <= total <= TND_MAX_TOKENS, f"npu_fusion_attention: T={total} (1 to {TND_MAX_TOKENS})")
        seq = [int(x) for x in seq]
        _check(seq[0] >= 0 and all(b >= a for a, b in zip(seq, seq[1:])) and seq[-1] == total,
               f"npu_fusion_attention: {name} {seq} must be cumulative lengths without a leading 0, ending at "
               f"T={total}")
        bounds.append([0, *seq])
    cq, ck = bounds
    return [(cq[b], cq[b + 1], ck[b], ck[b + 1]) for b in range(len(cq) - 1)]


def _tnd_masked(atten_mask, sparse_mode, pre, nxt, sq, sk, device):
    """[sq, sk] (True = masked out) or None for one segment; refuses fully masked rows."""
    _check(sparse_mode in TND_SPARSE_MODES, f"npu_fusion_attention: sparse_mode {sparse_mode} in TND (the FAKE "
           f"takes {TND_SPARSE_MODES})")
    if sparse_mode == 0:
        _check(atten_mask is None, "npu_fusion_attention: the FAKE does not implement an atten_mask in TND mode 0")
        return None
    _check(atten_mask is not None and tuple(atten_mask.shape) == (COMPRESSED_MASK, COMPRESSED_MASK)
           and torch.equal(atten_mask.to(torch.bool), _compressed_causal(atten_mask.device)),
           f"npu_fusion_attention: sparse_mode {sparse_mode} takes triu(ones(2048, 2048), 1) as atten_mask")
    rows = torch.arange(sq, device=device).unsqueeze(-1)
    cols = torch.arange(sk, device=device)
    if sparse_mode == 2:
        masked = cols > rows
    elif sparse_mode == 3:
        masked = cols > rows + (sk - sq)
    else:
        _check(pre >= -nxt, f"npu_fusion_attention: band pre_tockens {pre}, next_tockens {nxt} do not intersect")
        diagonal = rows + (sk - sq)
        masked = (cols > diagonal + nxt) | (cols < diagonal - pre)
    _check(sq == 0 or not bool(masked.all(-1).any()),
           "npu_fusion_attention: a fully masked row in the TND layout (its atten_mask may have no all-1 row)")
    return masked


def _tnd_scores(query, key, value, head_num, atten_mask, scale, pre, nxt, bounds, sparse_mode):
    """Per segment: (rows, keys, [N, sq, D] q, k, v in float32, [N, sq, sk] masked scores, mask)."""
    group = head_num // key.shape[1]
    for q0, q1, k0, k1 in bounds:
        if q1 == q0:  # an empty segment (documented as allowed)
            continue
        masked = _tnd_masked(atten_mask, sparse_mode, pre, nxt, q1 - q0, k1 - k0, query.device)
        qb = query[q0:q1].float().transpose(0, 1)
        kb = key[k0:k1].float().repeat_interleave(group, 1).transpose(0, 1)
        vb = value[k0:k1].float().repeat_interleave(group, 1).transpose(0, 1)
        scores = (qb @ kb.transpose(-1, -2)) * scale
        if masked is not None:
            scores = scores.masked_fill(masked, MASKED)
        yield slice(q0, q1), slice(k0, k1), qb, kb, vb, scores, masked


def _tnd_forward(query, key, value, head_num, atten_mask, scale, pre, nxt, actual_seq_qlen, actual_seq_kvlen,
                 sparse_mode, softmax_layout):
    _check(softmax_layout in ("", "TND"), f"npu_fusion_attention: softmax_layout {softmax_layout!r}")
    bounds = _tnd_segments(query, key, value, head_num, actual_seq_qlen, actual_seq_kvlen)
    t, n = query.shape[:2]
    out = torch.zeros(t, n, value.shape[-1], dtype=torch.float32, device=query.device)
    row_max = torch.zeros(t, n, dtype=torch.float32, device=query.device)
    row_sum = torch.zeros_like(row_max)
    for rows, _, _, _, vb, scores, _ in _tnd_scores(query, key, value, head_num, atten_mask, scale, pre, nxt,
                                                    bounds, sparse_mode):
        peak = scores.amax(-1, keepdim=True)
        exp = torch.exp(scores - peak)
        total = exp.sum(-1, keepdim=True)
        out[rows] = (exp / total @ vb).transpose(0, 1)
        row_max[rows], row_sum[rows] = peak[..., 0].transpose(0, 1), total[..., 0].transpose(0, 1)
    widen = (t, n, 8)  # softmax_max and softmax_sum: [T, N, 8] float32
    return (out.to(query.dtype), row_max.unsqueeze(-1).expand(widen).contiguous(),
            row_sum.unsqueeze(-1).expand(widen).contiguous(), query.new_empty(0), 0, 0, 0)


def _tnd_backward(query, key, value, dy, head_num, atten_mask, softmax_max, softmax_sum, attention_in, scale, pre,
                  nxt, actual_seq_qlen, actual_seq_kvlen, sparse_mode):
    bounds = _tnd_segments(query, key, value, head_num, actual_seq_qlen, actual_seq_kvlen)
    _check(tuple(softmax_max.shape) == (*query.shape[:2], 8) and softmax_sum.shape == softmax_max.shape,
           f"npu_fusion_attention_grad: TND softmax_max/sum {tuple(softmax_max.shape)}, not [T, N, 8]")
    _check(attention_in is not None and attention_in.shape == dy.shape,
           "npu_fusion_attention_grad: TND needs attention_in, the forward's output")
    group = head_num // key.shape[1]
    dq = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    dk = torch.zeros(key.shape[0], head_num, key.shape[2], dtype=torch.float32, device=query.device)
    dv = torch.zeros(value.shape[0], head_num, value.shape[2], dtype=torch.float32, device=query.device)
    delta = (dy.float() * attention_in.float()).sum(-1)  # [T, N]: the kernel's rowsum(dy * attention_in)
    for rows, keys, qb, kb, vb, scores, masked in _tnd_scores(query, key, value, head_num, atten_mask, scale, pre,
                                                              nxt, bounds, sparse_mode):
        peak = softmax_max[rows, :, :1].transpose(0, 1)
        probs = torch.exp(scores - peak) / softmax_sum[rows, :, :1].transpose(0, 1)
        g = dy[rows].float().transpose(0, 1)
        d_scores = probs * (g @ vb.transpose(-1, -2) - delta[rows].transpose(0, 1).unsqueeze(-1))
        if masked is not None:
            d_scores = d_scores.masked_fill(masked, 0.0)
        dv[keys] += (probs.transpose(-1, -2) @ g).transpose(0, 1)
        dq[rows] = (d_scores @ kb).transpose(0, 1) * scale
        dk[keys] += (d_scores.transpose(-1, -2) @ qb).transpose(0, 1) * scale
    n_kv = key.shape[1]
    dk = dk.view(key.shape[0], n_kv, group, -1).sum(2)
    dv = dv.view(value.shape[0], n_kv, group, -1).sum(2)
    return (dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), query.new_empty(0), query.new_empty(0))


KERNELS = {
    "npu_fusion_attention": (fusion_attention, _meta, (_autograd, _setup)),
    "npu_fusion_attention_grad": (fusion_attention_grad, _grad_meta, None),
}


def register(lib, define) -> dict:
    define(lib, SCHEMAS, KERNELS)
    return {name: getattr(torch.ops.npu, name) for name in KERNELS}
