// rms_norm on the CPU, forward and backward: one pass over each row, fp32 accumulation, rows split across threads.
// The weight gradient sums every row of a task in one chain, so it is accumulated in fp64 (the products of fp32
// values are exact there): an fp32 chain over the rows had about twice the error of torch's pairwise sum.
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "common.h"

namespace {

using namespace mm_adaptor::cpu;

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
      at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
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
  const int64_t tasks = std::max<int64_t>(
      1, std::min<int64_t>({static_cast<int64_t>(at::get_num_threads()), rows, rows * n / kMinTaskElements}));
  auto dw_parts = at::zeros({tasks, n}, x.options().dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm_bwd", [&] {
    using T = scalar_t;
    using A = at::opmath_type<T>;  // float for half/bf16/float, double for double
    const T* xp = x.data_ptr<T>();
    const T* dyp = dy.data_ptr<T>();
    T* dxp = dx.data_ptr<T>();
    const A* rp = rstd.data_ptr<A>();
    double* dwp = dw_parts.data_ptr<double>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w.scalar_type(), "rms_norm_bwd_w", [&] {
      using W = scalar_t;
      const W* wp = w.data_ptr<W>();
      const int64_t per_task = (rows + tasks - 1) / tasks;
      at::parallel_for(0, tasks, 1, [&](int64_t tb, int64_t te) {
        for (int64_t t = tb; t < te; ++t) {
          double* dw_acc = dwp + t * n;
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
                dw_acc[i + j] += static_cast<double>(g) * static_cast<double>(xhat);
              }
            }
            for (; i < n; ++i) {
              const A xhat = static_cast<A>(xr[i]) * inv;
              const A g = static_cast<A>(dyr[i]);
              partial[0] += g * static_cast<A>(wp[i]) * xhat;
              dw_acc[i] += static_cast<double>(g) * static_cast<double>(xhat);
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

}  // namespace

TORCH_LIBRARY_IMPL(mm_adaptor, CPU, m) {
  m.impl("rms_norm_fwd", &rms_norm_fwd);
  m.impl("rms_norm_bwd", &rms_norm_bwd);
}
