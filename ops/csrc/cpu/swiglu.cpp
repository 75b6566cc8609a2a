// swiglu on the CPU, forward and backward: silu(a) * b over blocks of each row, fp32 accumulation.
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common.h"

namespace {

using namespace mm_adaptor::cpu;

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

// Element-wise kernels run over blocks of at most kEltBlock elements (widened to A in stack buffers).
constexpr int64_t kEltBlock = 512;

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
    at::parallel_for(0, rows, grain_rows(3 * n), [&](int64_t begin, int64_t end) {
      A a_buf[kEltBlock], b_buf[kEltBlock], y_buf[kEltBlock];
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t i = 0; i < n; i += kEltBlock) {
          const int64_t len = std::min(kEltBlock, n - i);
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
    at::parallel_for(0, rows, grain_rows(3 * n), [&](int64_t begin, int64_t end) {
      A a_buf[kEltBlock], b_buf[kEltBlock], g_buf[kEltBlock], da_buf[kEltBlock], db_buf[kEltBlock];
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t i = 0; i < n; i += kEltBlock) {
          const int64_t len = std::min(kEltBlock, n - i);
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

}  // namespace

TORCH_LIBRARY_IMPL(mm_adaptor, CPU, m) {
  m.impl("swiglu_fwd", &swiglu_fwd);
  m.impl("swiglu_bwd", &swiglu_bwd);
}
