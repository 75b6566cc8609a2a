// Variable-length (packed THD) attention on the CPU, forward and backward. Each query row runs an online softmax
// over the one contiguous range of keys it sees in its segment (the causal and window bounds), in blocks of kKeyBlock
// scores; fp32 accumulation (fp64 for fp64 inputs). Memory O(T * H * D): no score matrix is ever formed.
// Backward recomputes the probabilities from the log-sum-exp: one pass over query rows for dq, one over key rows
// (the queries that see a key are a contiguous range too) for dk and dv, so no two threads write one row.
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "common.h"

namespace {

using namespace mm_adaptor::cpu;

constexpr int64_t kKeyBlock = 64;
constexpr int64_t kUnlimited = -1;

struct Layout {
  std::vector<int64_t> cq, ck;            // cumulative lengths
  std::vector<int64_t> q_segment, k_segment;  // segment of each query / key row
  bool causal;
  int64_t left, right;  // window sides, kUnlimited for none; causal folds into right

  // Keys [lo, hi) of its segment that segment-local query i sees (bottom-right aligned).
  void keys(int64_t b, int64_t i, int64_t& lo, int64_t& hi) const {
    const int64_t sq = cq[b + 1] - cq[b], sk = ck[b + 1] - ck[b];
    const int64_t diagonal = i + sk - sq;
    hi = right == kUnlimited ? sk : std::clamp<int64_t>(diagonal + right + 1, 0, sk);
    lo = left == kUnlimited ? 0 : std::clamp<int64_t>(diagonal - left, 0, sk);
    hi = std::max(hi, lo);
  }

  // Queries [lo, hi) of its segment that see segment-local key j.
  void queries(int64_t b, int64_t j, int64_t& lo, int64_t& hi) const {
    const int64_t sq = cq[b + 1] - cq[b], sk = ck[b + 1] - ck[b];
    const int64_t shift = sk - sq;
    lo = right == kUnlimited ? 0 : std::clamp<int64_t>(j - shift - right, 0, sq);
    hi = left == kUnlimited ? sq : std::clamp<int64_t>(j - shift + left + 1, 0, sq);
    hi = std::max(hi, lo);
  }
};

std::vector<int64_t> read_cumulative(const at::Tensor& cu, int64_t total, const char* name) {
  TORCH_CHECK(cu.dim() == 1 && cu.numel() >= 1, "varlen_attention: ", name, " must be 1-D");
  auto values = cu.to(at::kLong).contiguous();
  std::vector<int64_t> out(values.data_ptr<int64_t>(), values.data_ptr<int64_t>() + values.numel());
  TORCH_CHECK(out.front() == 0 && out.back() == total, "varlen_attention: ", name, " must rise from 0 to ", total);
  for (size_t b = 1; b < out.size(); ++b) {
    TORCH_CHECK(out[b] >= out[b - 1], "varlen_attention: ", name, " decreases at entry ", b);
  }
  return out;
}

std::vector<int64_t> segment_of_rows(const std::vector<int64_t>& cu) {
  std::vector<int64_t> segment(cu.back());
  for (size_t b = 0; b + 1 < cu.size(); ++b) std::fill(segment.begin() + cu[b], segment.begin() + cu[b + 1], b);
  return segment;
}

Layout make_layout(const at::Tensor& cu_q, const at::Tensor& cu_k, int64_t tq, int64_t tk, bool causal, int64_t left,
                   int64_t right) {
  TORCH_CHECK(cu_q.numel() == cu_k.numel(), "varlen_attention: cu_seqlens_q and cu_seqlens_k differ in length");
  TORCH_CHECK(left >= kUnlimited && right >= kUnlimited, "varlen_attention: window sides must be >= -1");
  Layout layout{read_cumulative(cu_q, tq, "cu_seqlens_q"), read_cumulative(cu_k, tk, "cu_seqlens_k"), {}, {},
                causal, left, causal ? 0 : right};
  layout.q_segment = segment_of_rows(layout.cq);
  layout.k_segment = segment_of_rows(layout.ck);
  return layout;
}

// Independent partial sums per lane, so that the compiler vectorises the loop without reassociating a reduction.
constexpr int64_t kLanes = 16;

template <typename A>
inline A dot(const A* __restrict__ a, const A* __restrict__ b, int64_t n) {
  A lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += a[i + l] * b[i + l];
  }
  A sum = 0;
  for (; i < n; ++i) sum += a[i] * b[i];
  for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

template <typename A>
inline void axpy(A alpha, const A* __restrict__ x, A* __restrict__ y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

template <typename A>
void forward_kernel(const Layout& layout, const A* q, const A* k, const A* v, A* out, A* lse, int64_t tq, int64_t hq,
                    int64_t hk, int64_t d, int64_t dv, A scale) {
  const int64_t group = hq / hk;
  at::parallel_for(0, tq * hq, grain_rows(4 * d * kKeyBlock), [&](int64_t begin, int64_t end) {
    A scores[kKeyBlock];
    std::vector<A> acc(dv);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t t = row / hq, h = row % hq, kh = h / group;
      const int64_t b = layout.q_segment[t];
      int64_t lo, hi;
      layout.keys(b, t - layout.cq[b], lo, hi);
      const A* qi = q + row * d;
      std::fill(acc.begin(), acc.end(), A(0));
      A running_max = -std::numeric_limits<A>::infinity(), total = 0;
      for (int64_t j0 = lo; j0 < hi; j0 += kKeyBlock) {
        const int64_t n = std::min(kKeyBlock, hi - j0);
        A block_max = -std::numeric_limits<A>::infinity();
        for (int64_t jj = 0; jj < n; ++jj) {
          scores[jj] = scale * dot(qi, k + ((layout.ck[b] + j0 + jj) * hk + kh) * d, d);
          block_max = std::max(block_max, scores[jj]);
        }
        const A new_max = std::max(running_max, block_max);
        const A correction = std::exp(running_max - new_max);  // 0 on the first block
        total *= correction;
        for (int64_t e = 0; e < dv; ++e) acc[e] *= correction;
        for (int64_t jj = 0; jj < n; ++jj) {
          const A p = std::exp(scores[jj] - new_max);
          total += p;
          axpy(p, v + ((layout.ck[b] + j0 + jj) * hk + kh) * dv, acc.data(), dv);
        }
        running_max = new_max;
      }
      A* o = out + row * dv;
      const A inverse = total > 0 ? A(1) / total : A(0);
      for (int64_t e = 0; e < dv; ++e) o[e] = acc[e] * inverse;
      lse[h * tq + t] = total > 0 ? running_max + std::log(total) : -std::numeric_limits<A>::infinity();
    }
  });
}

template <typename A>
void backward_kernel(const Layout& layout, const A* q, const A* k, const A* v, const A* out, const A* lse,
                     const A* dout, const A* dlse, A* dq, A* dk, A* dv_out, A* delta, int64_t tq, int64_t tk, int64_t hq,
                     int64_t hk, int64_t d, int64_t dv, A scale) {
  const int64_t group = hq / hk;
  const int64_t grain = grain_rows(4 * d * kKeyBlock);
  // dq, one query row at a time; delta = rowsum(dout * out) - dlse, kept for the key pass
  at::parallel_for(0, tq * hq, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t t = row / hq, h = row % hq, kh = h / group;
      const int64_t b = layout.q_segment[t];
      const A* g = dout + row * dv;
      const A row_delta = dot(g, out + row * dv, dv) - (dlse ? dlse[h * tq + t] : A(0));
      delta[row] = row_delta;
      A* dqi = dq + row * d;
      std::fill(dqi, dqi + d, A(0));
      int64_t lo, hi;
      layout.keys(b, t - layout.cq[b], lo, hi);
      const A* qi = q + row * d;
      const A row_lse = lse[h * tq + t];
      for (int64_t j = lo; j < hi; ++j) {
        const int64_t key = (layout.ck[b] + j) * hk + kh;
        const A p = std::exp(scale * dot(qi, k + key * d, d) - row_lse);
        const A ds = p * (dot(g, v + key * dv, dv) - row_delta);
        axpy(ds * scale, k + key * d, dqi, d);
      }
    }
  });
  // dk and dv, one key row at a time, summed over the query heads of its group
  at::parallel_for(0, tk * hk, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t s = row / hk, kh = row % hk;
      const int64_t b = layout.k_segment[s];
      const A* kj = k + row * d;
      const A* vj = v + row * dv;
      A* dkj = dk + row * d;
      A* dvj = dv_out + row * dv;
      std::fill(dkj, dkj + d, A(0));
      std::fill(dvj, dvj + dv, A(0));
      int64_t lo, hi;
      layout.queries(b, s - layout.ck[b], lo, hi);
      for (int64_t h = kh * group; h < (kh + 1) * group; ++h) {
        for (int64_t i = lo; i < hi; ++i) {
          const int64_t t = layout.cq[b] + i;
          const int64_t query = t * hq + h;
          const A p = std::exp(scale * dot(q + query * d, kj, d) - lse[h * tq + t]);
          const A* g = dout + query * dv;
          axpy(p, g, dvj, dv);
          const A ds = p * (dot(g, vj, dv) - delta[query]);
          axpy(ds * scale, q + query * d, dkj, d);
        }
      }
    }
  });
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "varlen_attention: expected [T, H, D] tensors");
  TORCH_CHECK(k.size(0) == v.size(0) && k.size(1) == v.size(1) && q.size(2) == k.size(2),
              "varlen_attention: q, k, v shapes do not match");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "varlen_attention: query heads must be a multiple of key/value heads");
}

std::tuple<at::Tensor, at::Tensor> varlen_attention_fwd(const at::Tensor& q_in, const at::Tensor& k_in,
                                                        const at::Tensor& v_in, const at::Tensor& cu_q,
                                                        const at::Tensor& cu_k, int64_t max_q, int64_t max_k,
                                                        bool causal, double scale, int64_t left, int64_t right) {
  check_inputs(q_in, k_in, v_in);
  const auto acc = acc_type(q_in);
  auto q = q_in.to(acc).contiguous(), k = k_in.to(acc).contiguous(), v = v_in.to(acc).contiguous();
  const int64_t tq = q.size(0), hq = q.size(1), d = q.size(2), hk = k.size(1), dv = v.size(2);
  const Layout layout = make_layout(cu_q, cu_k, tq, k.size(0), causal, left, right);
  auto out = at::empty({tq, hq, dv}, q.options());
  auto lse = at::empty({hq, tq}, q.options());
  AT_DISPATCH_FLOATING_TYPES(acc, "varlen_attention_fwd", [&] {
    forward_kernel<scalar_t>(layout, q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                             out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(), tq, hq, hk, d, dv,
                             static_cast<scalar_t>(scale));
  });
  return {out.to(q_in.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_bwd(
    const at::Tensor& dout_in, const std::optional<at::Tensor>& dlse_in, const at::Tensor& q_in,
    const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& lse_in,
    const at::Tensor& cu_q, const at::Tensor& cu_k, int64_t max_q, int64_t max_k, bool causal, double scale,
    int64_t left, int64_t right) {
  check_inputs(q_in, k_in, v_in);
  const auto acc = acc_type(q_in);
  auto q = q_in.to(acc).contiguous(), k = k_in.to(acc).contiguous(), v = v_in.to(acc).contiguous();
  auto out = out_in.to(acc).contiguous(), dout = dout_in.to(acc).contiguous(), lse = lse_in.to(acc).contiguous();
  std::optional<at::Tensor> dlse;
  if (dlse_in.has_value() && dlse_in->defined()) dlse = dlse_in->to(acc).contiguous();
  const int64_t tq = q.size(0), hq = q.size(1), d = q.size(2), tk = k.size(0), hk = k.size(1), dv = v.size(2);
  const Layout layout = make_layout(cu_q, cu_k, tq, tk, causal, left, right);
  auto dq = at::empty_like(q), dk = at::empty_like(k), dvt = at::empty_like(v);
  auto delta = at::empty({tq, hq}, q.options());
  AT_DISPATCH_FLOATING_TYPES(acc, "varlen_attention_bwd", [&] {
    backward_kernel<scalar_t>(layout, q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                              out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(), dout.data_ptr<scalar_t>(),
                              dlse ? dlse->data_ptr<scalar_t>() : nullptr, dq.data_ptr<scalar_t>(),
                              dk.data_ptr<scalar_t>(), dvt.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(), tq, tk,
                              hq, hk, d, dv, static_cast<scalar_t>(scale));
  });
  return {dq.to(q_in.scalar_type()), dk.to(k_in.scalar_type()), dvt.to(v_in.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(mm_adaptor, CPU, m) {
  m.impl("varlen_attention_fwd", &varlen_attention_fwd);
  m.impl("varlen_attention_bwd", &varlen_attention_bwd);
}
