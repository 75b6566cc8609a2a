// swiglu on CUDA: a pure elementwise pass over 16-byte packs. Rows are spread over gridDim.y and a row's
// packs over gridDim.x, so no thread divides an index; the backward recomputes silu from x.
#include <torch/library.h>

#include "vectorized.cuh"

namespace {

using namespace mm_adaptor_cuda;

constexpr int kThreads = 256;

__device__ __forceinline__ float sigmoid_acc(float v) {
  return 1.f / (1.f + __expf(-v));
}
__device__ __forceinline__ double sigmoid_acc(double v) {
  return 1.0 / (1.0 + exp(-v));
}

// x rows are [a (n) | b (n)]; y rows are n wide.
template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    swiglu_fwd_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int64_t n) {
  using A = acc_t<T>;
  const int64_t p = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * N;
  if (p >= n) return;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const T* xr = x + row * 2 * n;
    const Pack<T, N> a = load<N>(xr + p);
    const Pack<T, N> b = load<N>(xr + n + p);
    Pack<T, N> out;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const A av = static_cast<A>(a.v[k]);
      out.v[k] = static_cast<T>(av * sigmoid_acc(av) * static_cast<A>(b.v[k]));
    }
    store<N>(y + row * n + p, out);
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    swiglu_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx, int64_t rows,
                      int64_t n) {
  using A = acc_t<T>;
  const int64_t p = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * N;
  if (p >= n) return;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const T* xr = x + row * 2 * n;
    const Pack<T, N> a = load<N>(xr + p);
    const Pack<T, N> b = load<N>(xr + n + p);
    const Pack<T, N> g = load<N>(dy + row * n + p);
    Pack<T, N> da, db;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const A av = static_cast<A>(a.v[k]), bv = static_cast<A>(b.v[k]), gv = static_cast<A>(g.v[k]);
      const A sig = sigmoid_acc(av);
      da.v[k] = static_cast<T>(gv * bv * sig * (A(1) + av * (A(1) - sig)));
      db.v[k] = static_cast<T>(gv * av * sig);
    }
    T* dxr = dx + row * 2 * n;
    store<N>(dxr + p, da);
    store<N>(dxr + n + p, db);
  }
}

// Launches kernel<T, N> with the widest pack every pointer and the half-row width allow.
template <typename T, typename F>
void with_pack_width(int64_t n, std::initializer_list<const void*> pointers, F&& f) {
  constexpr int widest = pack_width<T>();
  bool fits = n % widest == 0;
  for (const void* p : pointers) fits = fits && aligned_to(p, 16);
  if (fits) {
    f(std::integral_constant<int, widest>{});
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

std::pair<dim3, dim3> grid_for(int64_t rows, int64_t n, int width) {
  const int64_t packs = n / width;
  const int threads = static_cast<int>(std::min<int64_t>(kThreads, round_up_to_warp(packs)));
  const dim3 grid(static_cast<unsigned>(ceil_div(packs, threads)), static_cast<unsigned>(std::min(rows, kMaxGridY)));
  return {grid, dim3(threads)};
}

at::Tensor swiglu_fwd(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) % 2 == 0, "swiglu: the last dimension must be even, got ",
              x_in.dim() ? x_in.size(-1) : 0);
  const c10::cuda::CUDAGuard guard(x_in.device());
  auto x = x_in.contiguous();
  const int64_t n = x.size(-1) / 2, rows = n ? x.numel() / (2 * n) : 0;
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto y = at::empty(sizes, x.options());
  if (rows == 0 || n == 0) return y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "swiglu_fwd", [&] {
    using T = scalar_t;
    with_pack_width<T>(n, {x.data_ptr(), y.data_ptr()}, [&](auto width) {
      constexpr int N = decltype(width)::value;
      const auto [grid, block] = grid_for(rows, n, N);
      swiglu_fwd_kernel<T, N><<<grid, block, 0, c10::cuda::getCurrentCUDAStream()>>>(x.data_ptr<T>(),
                                                                                     y.data_ptr<T>(), rows, n);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return y;
}

at::Tensor swiglu_bwd(const at::Tensor& dy_in, const at::Tensor& x_in) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  auto x = x_in.contiguous();
  auto dy = dy_in.contiguous();
  const int64_t n = x.size(-1) / 2, rows = n ? x.numel() / (2 * n) : 0;
  TORCH_CHECK(dy.numel() == rows * n, "swiglu backward: dy has ", dy.numel(), " elements, expected ", rows * n);
  auto dx = at::empty_like(x);
  if (rows == 0 || n == 0) return dx;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "swiglu_bwd", [&] {
    using T = scalar_t;
    with_pack_width<T>(n, {x.data_ptr(), dy.data_ptr(), dx.data_ptr()}, [&](auto width) {
      constexpr int N = decltype(width)::value;
      const auto [grid, block] = grid_for(rows, n, N);
      swiglu_bwd_kernel<T, N><<<grid, block, 0, c10::cuda::getCurrentCUDAStream()>>>(
          dy.data_ptr<T>(), x.data_ptr<T>(), dx.data_ptr<T>(), rows, n);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return dx;
}

}  // namespace

TORCH_LIBRARY_IMPL(mm_adaptor, CUDA, m) {
  m.impl("swiglu_fwd", &swiglu_fwd);
  m.impl("swiglu_bwd", &swiglu_bwd);
}
