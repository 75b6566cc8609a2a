// rms_norm on CUDA. One row per block, kept in registers as 16-byte packs between the block-wide sum and
// the write; the weight gradient is summed per block in fp32 registers over the rows the block visits, and
// the [blocks, hidden] partials are reduced by a second small kernel (no [rows, hidden] buffer).
#include <torch/library.h>

#include <tuple>

#include "vectorized.cuh"

namespace {

using namespace mm_adaptor_cuda;

constexpr int kMaxThreads = 512;
constexpr int kMaxPacksPerThread = 8;

template <typename T, typename W, int N, int kPacks>
__global__ void __launch_bounds__(kMaxThreads)
    rms_norm_fwd_kernel(const T* __restrict__ x, const W* __restrict__ w, T* __restrict__ y,
                        acc_t<T>* __restrict__ rstd, int64_t rows, int n, acc_t<T> eps) {
  using A = acc_t<T>;
  const int packs = n / N;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * n;
    Pack<T, N> xv[kPacks];
    A squares = 0;
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
      const int p = threadIdx.x + j * blockDim.x;
      if (p < packs) {
        xv[j] = load<N>(xr + p * N);
#pragma unroll
        for (int k = 0; k < N; ++k) {
          const A v = static_cast<A>(xv[j].v[k]);
          squares += v * v;
        }
      }
    }
    const A inv = rsqrt_acc(block_sum(squares) / static_cast<A>(n) + eps);
    if (threadIdx.x == 0) rstd[row] = inv;
    T* yr = y + row * n;
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
      const int p = threadIdx.x + j * blockDim.x;
      if (p < packs) {
        const Pack<W, N> wv = load<N>(w + p * N);
        Pack<T, N> out;
#pragma unroll
        for (int k = 0; k < N; ++k) {
          out.v[k] = static_cast<T>(static_cast<A>(xv[j].v[k]) * inv * static_cast<A>(wv.v[k]));
        }
        store<N>(yr + p * N, out);
      }
    }
  }
}

template <typename T, typename W, int N, int kPacks>
__global__ void __launch_bounds__(kMaxThreads)
    rms_norm_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, const W* __restrict__ w,
                        const acc_t<T>* __restrict__ rstd, T* __restrict__ dx, acc_t<T>* __restrict__ dw_partial,
                        int64_t rows, int n) {
  using A = acc_t<T>;
  const int packs = n / N;
  A dw[kPacks][N];  // the weight is re-read per row (from L1/L2) rather than held, to leave registers for dw
#pragma unroll
  for (int j = 0; j < kPacks; ++j) {
#pragma unroll
    for (int k = 0; k < N; ++k) dw[j][k] = 0;
  }
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * n;
    const T* gr = dy + row * n;
    const A inv = rstd[row];
    Pack<T, N> xv[kPacks], gv[kPacks];
    A dot = 0;
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
      const int p = threadIdx.x + j * blockDim.x;
      if (p < packs) {
        xv[j] = load<N>(xr + p * N);
        gv[j] = load<N>(gr + p * N);
        const Pack<W, N> wv = load<N>(w + p * N);
#pragma unroll
        for (int k = 0; k < N; ++k) {
          const A xhat = static_cast<A>(xv[j].v[k]) * inv;
          const A g = static_cast<A>(gv[j].v[k]);
          dot += g * static_cast<A>(wv.v[k]) * xhat;
          dw[j][k] += g * xhat;
        }
      }
    }
    const A mean_dot = block_sum(dot) / static_cast<A>(n);
    T* dxr = dx + row * n;
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
      const int p = threadIdx.x + j * blockDim.x;
      if (p < packs) {
        const Pack<W, N> wv = load<N>(w + p * N);
        Pack<T, N> out;
#pragma unroll
        for (int k = 0; k < N; ++k) {
          const A xhat = static_cast<A>(xv[j].v[k]) * inv;
          out.v[k] = static_cast<T>(inv * (static_cast<A>(gv[j].v[k]) * static_cast<A>(wv.v[k]) - xhat * mean_dot));
        }
        store<N>(dxr + p * N, out);
      }
    }
  }
  A* partial = dw_partial + static_cast<int64_t>(blockIdx.x) * n;
#pragma unroll
  for (int j = 0; j < kPacks; ++j) {
    const int p = threadIdx.x + j * blockDim.x;
    if (p < packs) {
      Pack<A, N> out;
#pragma unroll
      for (int k = 0; k < N; ++k) out.v[k] = dw[j][k];
      store<N>(partial + p * N, out);
    }
  }
}

// dw[c] = sum over blocks of partial[b, c]: 32 columns per block (coalesced), 8 rows of blocks summed in
// parallel and combined through shared memory.
template <typename A, typename W>
__global__ void column_sum_kernel(const A* __restrict__ partial, W* __restrict__ out, int64_t groups, int n) {
  __shared__ A sums[8][33];
  const int col = blockIdx.x * 32 + threadIdx.x;
  A s = 0;
  if (col < n) {
    for (int64_t g = threadIdx.y; g < groups; g += 8) s += partial[g * n + col];
  }
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < n) {
    A total = 0;
#pragma unroll
    for (int r = 0; r < 8; ++r) total += sums[r][threadIdx.x];
    out[col] = static_cast<W>(total);
  }
}

// Packs per thread so that a row fits in at most kMaxThreads threads' registers; 0 when it does not fit.
int packs_per_thread(int64_t packs) {
  for (int per = 1; per <= kMaxPacksPerThread; per *= 2) {
    if (packs <= static_cast<int64_t>(per) * kMaxThreads) return per;
  }
  return 0;
}

template <typename T>
int widest_pack(const at::Tensor& a, const at::Tensor& b, const at::Tensor& w, int64_t n) {
  constexpr int widest = pack_width<T>();
  const bool fits = n % widest == 0 && aligned_to(a.data_ptr(), 16) && aligned_to(b.data_ptr(), 16) &&
                    aligned_to(w.data_ptr(), static_cast<int64_t>(w.element_size()) * widest);
  return fits ? widest : 1;
}

// Calls f(std::integral_constant<int, N>, std::integral_constant<int, kPacks>) for the row's layout.
template <typename T, typename F>
bool with_row_layout(int n_pack, int64_t n, F&& f) {
  constexpr int widest = pack_width<T>();
  auto by_packs = [&](auto width) {
    switch (packs_per_thread(n / decltype(width)::value)) {
      case 1: f(width, std::integral_constant<int, 1>{}); return true;
      case 2: f(width, std::integral_constant<int, 2>{}); return true;
      case 4: f(width, std::integral_constant<int, 4>{}); return true;
      case 8: f(width, std::integral_constant<int, 8>{}); return true;
      default: return false;
    }
  };
  return n_pack == widest ? by_packs(std::integral_constant<int, widest>{})
                          : by_packs(std::integral_constant<int, 1>{});
}

int threads_for(int64_t n, int width, int packs) {
  return round_up_to_warp(ceil_div(n / width, packs));
}

// The kernels read the weight as the input's dtype or as fp32; anything else is converted the way the
// reference converts it (to the accumulation dtype).
at::Tensor kernel_weight(const at::Tensor& x, const at::Tensor& w) {
  if (x.scalar_type() == at::kDouble) return w.to(at::kDouble).contiguous();
  if (w.scalar_type() == x.scalar_type() || w.scalar_type() == at::kFloat) return w.contiguous();
  return w.to(at::kFloat).contiguous();
}

template <typename T, typename F>
void dispatch_weight(const at::Tensor& w, F&& f) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    f(T{});
  } else if (w.scalar_type() == c10::CppTypeToScalarType<T>::value) {
    f(T{});
  } else {
    f(float{});
  }
}

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == w_in.numel(),
              "rms_norm: weight has ", w_in.numel(), " elements but the hidden size is ", x_in.size(-1));
  const c10::cuda::CUDAGuard guard(x_in.device());
  auto x = x_in.contiguous();
  auto w = kernel_weight(x, w_in);
  const int64_t n = x.size(-1);
  const int64_t rows = n ? x.numel() / n : 0;
  const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto y = at::empty_like(x);
  auto rstd = at::empty({rows}, x.options().dtype(acc));
  if (rows == 0 || n == 0) return {y, rstd};
  bool launched = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm_fwd", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    dispatch_weight<T>(w, [&](auto weight_type) {
      using W = decltype(weight_type);
      launched = with_row_layout<T>(widest_pack<T>(x, y, w, n), n, [&](auto width, auto packs) {
        constexpr int N = decltype(width)::value, P = decltype(packs)::value;
        auto kernel = rms_norm_fwd_kernel<T, W, N, P>;
        const int threads = threads_for(n, N, P);
        const int64_t blocks = std::min<int64_t>(rows, kMaxGridX);
        kernel<<<blocks, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
            x.data_ptr<T>(), w.data_ptr<W>(), y.data_ptr<T>(), rstd.data_ptr<A>(), rows, static_cast<int>(n),
            static_cast<A>(eps));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
  if (!launched) {  // rows wider than the registers of one block hold: ATen ops, same formula
    auto xf = x.to(acc);
    auto r = at::rsqrt(xf.pow(2).mean(-1, true) + eps);
    y.copy_(xf * r * w.to(acc));
    rstd.copy_(r.reshape({-1}));
  }
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& dy_in, const at::Tensor& x_in,
                                                const at::Tensor& w_in, const at::Tensor& rstd_in) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  auto dy = dy_in.contiguous();
  auto x = x_in.contiguous();
  auto w = kernel_weight(x, w_in);
  const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto rstd = rstd_in.to(acc).contiguous();
  const int64_t n = x.size(-1);
  const int64_t rows = n ? x.numel() / n : 0;
  TORCH_CHECK(dy.sizes() == x.sizes(), "rms_norm backward: dy and x shapes differ");
  TORCH_CHECK(rstd.numel() == rows, "rms_norm backward: rstd has ", rstd.numel(), " values for ", rows, " rows");
  TORCH_CHECK(w.numel() == n, "rms_norm backward: weight has ", w.numel(), " elements but the hidden size is ", n);
  auto dx = at::empty_like(x);
  auto dw = at::empty({n}, w.options());
  if (rows == 0 || n == 0) return {dx, dw.zero_().to(w_in.scalar_type())};  // a sum over no rows is 0
  bool launched = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm_bwd", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    dispatch_weight<T>(w, [&](auto weight_type) {
      using W = decltype(weight_type);
      const int width = widest_pack<T>(x, dy, w, n) == pack_width<T>() && aligned_to(dx.data_ptr(), 16)
                            ? pack_width<T>() : 1;
      launched = with_row_layout<T>(width, n, [&](auto width_c, auto packs) {
        constexpr int N = decltype(width_c)::value, P = decltype(packs)::value;
        auto kernel = rms_norm_bwd_kernel<T, W, N, P>;
        const int threads = threads_for(n, N, P);
        const int64_t blocks = std::min<int64_t>(rows, resident_blocks(kernel, threads));
        auto partial = at::empty({blocks, n}, x.options().dtype(acc));
        auto stream = c10::cuda::getCurrentCUDAStream();
        kernel<<<blocks, threads, 0, stream>>>(dy.data_ptr<T>(), x.data_ptr<T>(), w.data_ptr<W>(),
                                               rstd.data_ptr<A>(), dx.data_ptr<T>(), partial.data_ptr<A>(), rows,
                                               static_cast<int>(n));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        column_sum_kernel<A, W><<<ceil_div(n, 32), dim3(32, 8), 0, stream>>>(
            partial.data_ptr<A>(), dw.data_ptr<W>(), blocks, static_cast<int>(n));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
  if (!launched) {
    const auto xhat = x.to(acc).reshape({rows, n}) * rstd.reshape({rows, 1});
    const auto g = dy.to(acc).reshape({rows, n});
    const auto wa = w.to(acc);
    const auto mean_dot = (g * wa * xhat).sum(-1, true) / static_cast<double>(n);
    dx.copy_((rstd.reshape({rows, 1}) * (g * wa - xhat * mean_dot)).reshape(x.sizes()));
    dw.copy_((g * xhat).sum(0));
  }
  return {dx, dw.to(w_in.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(mm_adaptor, CUDA, m) {
  m.impl("rms_norm_fwd", &rms_norm_fwd);
  m.impl("rms_norm_bwd", &rms_norm_bwd);
}
