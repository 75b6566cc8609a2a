// CPU kernels for the memory-bound ops: rms_norm, swiglu, rotary_pos_emb (forward and backward).
// One pass over the data each way, fp32 accumulation, rows split across threads with at::parallel_for.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <utility>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kGrain = 16;  // rows per task

// Accumulation (and rstd/freqs) dtype: double for double inputs, float otherwise.
at::ScalarType acc_type(const at::Tensor& t) { return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  TORCH_CHECK(x_in.size(-1) == w_in.numel(), "rms_norm: weight has ", w_in.numel(), " elements, hidden size is ",
              x_in.size(-1));
  auto x = x_in.contiguous();
  auto w = w_in.contiguous();
  const int64_t n = x.size(-1);
  const int64_t rows = n ? x.numel() / n : 0;
  auto y = at::empty(x.sizes(), x.options());
  auto rstd = at::empty({rows}, x.options().dtype(acc_type(x)));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm_fwd", [&] {
    using T = scalar_t;
    using A = at::opmath_type<T>;  // float for half/bf16/float, double for double
    const T* xp = x.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    A* rp = rstd.data_ptr<A>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w.scalar_type(), "rms_norm_fwd_w", [&] {
      using W = scalar_t;
      const W* wp = w.data_ptr<W>();
      at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          const T* xr = xp + r * n;
          A partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
          int64_t i = 0;
          for (; i + 8 <= n; i += 8) {
            for (int j = 0; j < 8; ++j) {
              const A v = static_cast<A>(xr[i + j]);
              partial[j] += v * v;
            }
          }
          for (; i < n; ++i) {
            const A v = static_cast<A>(xr[i]);
            partial[0] += v * v;
          }
          A sum = 0;
          for (int j = 0; j < 8; ++j) sum += partial[j];
          const A inv = A(1) / std::sqrt(sum / static_cast<A>(n) + static_cast<A>(eps));
          rp[r] = inv;
          T* yr = yp + r * n;
          for (int64_t i = 0; i < n; ++i) {
            yr[i] = static_cast<T>(static_cast<A>(xr[i]) * inv * static_cast<A>(wp[i]));
          }
        }
      });
    });
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& dy_in, const at::Tensor& x_in, const at::Tensor& w_in,
                                                const at::Tensor& rstd_in) {
  auto dy = dy_in.contiguous();
  auto x = x_in.contiguous();
  auto w = w_in.contiguous();
  auto rstd = rstd_in.to(acc_type(x_in)).contiguous();
  const int64_t n = x.size(-1);
  const int64_t rows = n ? x.numel() / n : 0;
  auto dx = at::empty_like(x);
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows));
  auto dw_parts = at::zeros({tasks, n}, x.options().dtype(acc_type(x)));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm_bwd", [&] {
    using T = scalar_t;
    using A = at::opmath_type<T>;  // float for half/bf16/float, double for double
    const T* xp = x.data_ptr<T>();
    const T* dyp = dy.data_ptr<T>();
    T* dxp = dx.data_ptr<T>();
    const A* rp = rstd.data_ptr<A>();
    A* dwp = dw_parts.data_ptr<A>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w.scalar_type(), "rms_norm_bwd_w", [&] {
      using W = scalar_t;
      const W* wp = w.data_ptr<W>();
      const int64_t per_task = (rows + tasks - 1) / tasks;
      at::parallel_for(0, tasks, 1, [&](int64_t tb, int64_t te) {
        for (int64_t t = tb; t < te; ++t) {
          A* dw_acc = dwp + t * n;
          const int64_t r_end = std::min(rows, (t + 1) * per_task);
          for (int64_t r = t * per_task; r < r_end; ++r) {
            const T* xr = xp + r * n;
            const T* dyr = dyp + r * n;
            const A inv = rp[r];
            A partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // sum(dy * w * x_hat), 8 lanes for vectorisation
            int64_t i = 0;
            for (; i + 8 <= n; i += 8) {
              for (int j = 0; j < 8; ++j) {
                const A xhat = static_cast<A>(xr[i + j]) * inv;
                const A g = static_cast<A>(dyr[i + j]);
                partial[j] += g * static_cast<A>(wp[i + j]) * xhat;
                dw_acc[i + j] += g * xhat;
              }
            }
            for (; i < n; ++i) {
              const A xhat = static_cast<A>(xr[i]) * inv;
              const A g = static_cast<A>(dyr[i]);
              partial[0] += g * static_cast<A>(wp[i]) * xhat;
              dw_acc[i] += g * xhat;
            }
            A dot = 0;
            for (int j = 0; j < 8; ++j) dot += partial[j];
            const A mean_dot = dot / static_cast<A>(n);
            T* dxr = dxp + r * n;
            for (int64_t i = 0; i < n; ++i) {
              const A xhat = static_cast<A>(xr[i]) * inv;
              dxr[i] = static_cast<T>(inv * (static_cast<A>(dyr[i]) * static_cast<A>(wp[i]) - xhat * mean_dot));
            }
          }
        }
      });
    });
  });
  auto dw = dw_parts.sum(0).to(w.scalar_type());
  return {dx, dw};
}

// exp for float that the compiler can vectorise (no libm call): Cody-Waite range reduction and a degree-6
// polynomial, relative error ~2 ulp; double keeps std::exp.
inline float vexp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}
inline double vexp(double x) { return std::exp(x); }

template <typename A>
inline A sigmoid(A a) { return A(1) / (A(1) + vexp(-a)); }

template <typename A>
inline A silu(A a) { return a * sigmoid(a); }

// Element-wise kernels run over blocks of at most kBlock elements in A (fp32 or fp64): half/bf16 inputs are
// widened into stack buffers first and results narrowed afterwards, each in a plain loop the compiler
// vectorises; the arithmetic then sees only A. For float inputs the buffers are skipped.
constexpr int64_t kBlock = 512;

template <typename T, typename A>
inline const A* widen(const T* __restrict__ src, A* __restrict__ buffer, int64_t len) {
  if constexpr (std::is_same_v<T, A>) {
    return src;
  } else {
    for (int64_t i = 0; i < len; ++i) buffer[i] = static_cast<A>(src[i]);
    return buffer;
  }
}

template <typename T, typename A>
inline A* output_buffer(T* dst, A* buffer) {
  if constexpr (std::is_same_v<T, A>) {
    return dst;
  } else {
    return buffer;
  }
}

template <typename T, typename A>
inline void narrow_into(const A* __restrict__ src, T* __restrict__ dst, int64_t len) {
  if constexpr (!std::is_same_v<T, A>) {
    for (int64_t i = 0; i < len; ++i) dst[i] = static_cast<T>(src[i]);
  }
}

template <typename A>
inline void swiglu_block(const A* __restrict__ a, const A* __restrict__ b, A* __restrict__ y, int64_t len) {
  for (int64_t i = 0; i < len; ++i) y[i] = silu(a[i]) * b[i];
}

template <typename A>
inline void swiglu_bwd_block(const A* __restrict__ a, const A* __restrict__ b, const A* __restrict__ g,
                             A* __restrict__ da, A* __restrict__ db, int64_t len) {
  for (int64_t i = 0; i < len; ++i) {
    const A sig = sigmoid(a[i]);
    da[i] = g[i] * b[i] * sig * (A(1) + a[i] * (A(1) - sig));
    db[i] = g[i] * a[i] * sig;
  }
}

at::Tensor swiglu_fwd(const at::Tensor& x_in) {
  auto x = x_in.contiguous();
  const int64_t n2 = x.size(-1);
  TORCH_CHECK(n2 % 2 == 0, "swiglu: last dimension must be even, got ", n2);
  const int64_t n = n2 / 2;
  const int64_t rows = n2 ? x.numel() / n2 : 0;
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = n;
  auto y = at::empty(out_sizes, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "swiglu_fwd", [&] {
    using T = scalar_t;
    using A = at::opmath_type<T>;  // float for half/bf16/float, double for double
    const T* xp = x.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
      A a_buf[kBlock], b_buf[kBlock], y_buf[kBlock];
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t i = 0; i < n; i += kBlock) {
          const int64_t len = std::min(kBlock, n - i);
          const T* a = xp + r * n2 + i;
          T* yr = yp + r * n + i;
          A* out = output_buffer<T, A>(yr, y_buf);
          swiglu_block<A>(widen<T, A>(a, a_buf, len), widen<T, A>(a + n, b_buf, len), out, len);
          narrow_into<T, A>(out, yr, len);
        }
      }
    });
  });
  return y;
}

at::Tensor swiglu_bwd(const at::Tensor& dy_in, const at::Tensor& x_in) {
  auto x = x_in.contiguous();
  auto dy = dy_in.contiguous();
  const int64_t n2 = x.size(-1);
  const int64_t n = n2 / 2;
  const int64_t rows = n2 ? x.numel() / n2 : 0;
  auto dx = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "swiglu_bwd", [&] {
    using T = scalar_t;
    using A = at::opmath_type<T>;  // float for half/bf16/float, double for double
    const T* xp = x.data_ptr<T>();
    const T* dyp = dy.data_ptr<T>();
    T* dxp = dx.data_ptr<T>();
    at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
      A a_buf[kBlock], b_buf[kBlock], g_buf[kBlock], da_buf[kBlock], db_buf[kBlock];
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t i = 0; i < n; i += kBlock) {
          const int64_t len = std::min(kBlock, n - i);
          const T* a = xp + r * n2 + i;
          T* da = dxp + r * n2 + i;
          A* da_out = output_buffer<T, A>(da, da_buf);
          A* db_out = output_buffer<T, A>(da + n, db_buf);
          swiglu_bwd_block<A>(widen<T, A>(a, a_buf, len), widen<T, A>(a + n, b_buf, len),
                              widen<T, A>(dyp + r * n + i, g_buf, len), da_out, db_out, len);
          narrow_into<T, A>(da_out, da, len);
          narrow_into<T, A>(db_out, da + n, len);
        }
      }
    });
  });
  return dx;
}

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
      at::parallel_for(0, s, 1, [&](int64_t sb, int64_t se) {
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
  m.impl("rms_norm_fwd", &rms_norm_fwd);
  m.impl("rms_norm_bwd", &rms_norm_bwd);
  m.impl("swiglu_fwd", &swiglu_fwd);
  m.impl("swiglu_bwd", &swiglu_bwd);
  m.impl("rotary_pos_emb_fwd", &rope_fwd);
  m.impl("rotary_pos_emb_bwd", &rope_bwd);
}
