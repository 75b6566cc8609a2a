// rotary_pos_emb on the CPU, forward and backward: one position's heads per task, cos/sin once per pair.
#include <torch/library.h>

#include <cmath>
#include <utility>
#include <vector>

#include "common.h"

namespace {

using namespace mm_adaptor::cpu;

// t: [s, b, h, d]; freqs: [s or 1, 1, 1, rot] angles. The first `rot` channels rotate in pairs
// (k, k + rot/2) for rotate-half or (2j, 2j + 1) for interleaved; the rest pass through.
// Forward per pair: y0 = x0 c0 - x1 s0, y1 = x1 c1 + x0 s1. Backward (its transpose):
// dx0 = g0 c0 + g1 s1, dx1 = g1 c1 - g0 s0.
template <bool kInterleaved>
inline std::pair<int64_t, int64_t> rope_pair(int64_t p, int64_t pairs) {
  return kInterleaved ? std::pair<int64_t, int64_t>{2 * p, 2 * p + 1} : std::pair<int64_t, int64_t>{p, p + pairs};
}

// One head.
template <bool kInterleaved, bool kBackward, typename A>
inline void rope_row(const A* __restrict__ x, A* __restrict__ y, const A* __restrict__ cs, const A* __restrict__ sn,
                     int64_t rot, int64_t d) {
  const int64_t pairs = rot / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const auto [i0, i1] = rope_pair<kInterleaved>(p, pairs);
    const A x0 = x[i0], x1 = x[i1];
    if constexpr (kBackward) {
      y[i0] = x0 * cs[i0] + x1 * sn[i1];
      y[i1] = x1 * cs[i1] - x0 * sn[i0];
    } else {
      y[i0] = x0 * cs[i0] - x1 * sn[i0];
      y[i1] = x1 * cs[i1] + x0 * sn[i1];
    }
  }
  for (int64_t k = rot; k < d; ++k) y[k] = x[k];
}

at::Tensor rope_apply(const at::Tensor& t_in, const at::Tensor& freqs_in, bool interleaved, bool backward) {
  TORCH_CHECK(t_in.dim() == 4, "rotary_pos_emb: expected a tensor of shape [s, b, h, d], got ", t_in.sizes());
  auto t = t_in.contiguous();
  auto freqs = freqs_in.to(acc_type(t_in)).contiguous();
  const int64_t s = t.size(0), b = t.size(1), h = t.size(2), d = t.size(3);
  const int64_t rot = freqs.size(-1);
  TORCH_CHECK(rot <= d && rot % 2 == 0, "rotary_pos_emb: rotary dim ", rot, " must be even and <= head dim ", d);
  TORCH_CHECK(freqs.numel() == freqs.size(0) * rot && (freqs.size(0) == s || freqs.size(0) == 1),
              "rotary_pos_emb: freqs must be [s, 1, 1, rot] with s = ", s, ", got ", freqs.sizes());
  const bool broadcast_s = freqs.size(0) == 1;
  auto out = at::empty_like(t);
  const int64_t slab = b * h * d;  // one position's heads, contiguous
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t.scalar_type(), "rotary_pos_emb", [&] {
    using T = scalar_t;
    using A = at::opmath_type<T>;  // float for half/bf16/float, double for double
    const T* tp = t.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const A* fp = freqs.data_ptr<A>();
    auto rotate = [&](auto interleaved_tag, auto backward_tag) {
      constexpr bool kInterleaved = decltype(interleaved_tag)::value;
      constexpr bool kBackward = decltype(backward_tag)::value;
      at::parallel_for(0, s, grain_rows(slab), [&](int64_t sb, int64_t se) {
        std::vector<A> cs(rot), sn(rot), x_buf(std::is_same_v<T, A> ? 0 : slab), y_buf(x_buf.size());
        for (int64_t si = sb; si < se; ++si) {
          const A* f = fp + (broadcast_s ? 0 : si * rot);
          for (int64_t p = 0; p < rot / 2; ++p) {
            // megatron repeats each angle within its pair: one cos/sin per pair then (libm dominates otherwise)
            const auto [i0, i1] = rope_pair<kInterleaved>(p, rot / 2);
            cs[i0] = std::cos(f[i0]);
            sn[i0] = std::sin(f[i0]);
            const bool same = f[i1] == f[i0];
            cs[i1] = same ? cs[i0] : std::cos(f[i1]);
            sn[i1] = same ? sn[i0] : std::sin(f[i1]);
          }
          const A* x_slab = widen<T, A>(tp + si * slab, x_buf.data(), slab);
          A* y_slab = output_buffer<T, A>(op + si * slab, y_buf.data());
          for (int64_t bh = 0; bh < b * h; ++bh) {
            rope_row<kInterleaved, kBackward, A>(x_slab + bh * d, y_slab + bh * d, cs.data(), sn.data(), rot, d);
          }
          narrow_into<T, A>(y_slab, op + si * slab, slab);
        }
      });
    };
    using yes = std::true_type;
    using no = std::false_type;
    if (interleaved) {
      backward ? rotate(yes{}, yes{}) : rotate(yes{}, no{});
    } else {
      backward ? rotate(no{}, yes{}) : rotate(no{}, no{});
    }
  });
  return out;
}

at::Tensor rope_fwd(const at::Tensor& t, const at::Tensor& freqs, bool interleaved) {
  return rope_apply(t, freqs, interleaved, false);
}

at::Tensor rope_bwd(const at::Tensor& dy, const at::Tensor& freqs, bool interleaved) {
  return rope_apply(dy, freqs, interleaved, true);
}

}  // namespace

TORCH_LIBRARY_IMPL(mm_adaptor, CPU, m) {
  m.impl("rotary_pos_emb_fwd", &rope_fwd);
  m.impl("rotary_pos_emb_bwd", &rope_bwd);
}
