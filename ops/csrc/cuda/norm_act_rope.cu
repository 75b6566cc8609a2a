// CUDA kernels for rms_norm, swiglu and rotary_pos_emb (forward and backward): one pass each way,
// fp32 accumulation, 16-byte vectorised loads where the row allows it.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <tuple>

namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ float to_f(T v) { return static_cast<float>(v); }
template <>
__device__ __forceinline__ float to_f<at::BFloat16>(at::BFloat16 v) { return static_cast<float>(v); }

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffff, v, offset);
  return v;
}

__device__ float block_sum(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = warp_sum(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = (threadIdx.x < blockDim.x / 32) ? partial[lane] : 0.f;
  if (warp == 0) v = warp_sum(v);
  __shared__ float total;
  if (threadIdx.x == 0) total = v;
  __syncthreads();
  return total;
}

template <typename T, typename W>
__global__ void rms_norm_fwd_kernel(const T* __restrict__ x, const W* __restrict__ w, T* __restrict__ y,
                                    float* __restrict__ rstd, int64_t n, float eps) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * n;
  T* yr = y + row * n;
  float sum = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = to_f(xr[i]);
    sum += v * v;
  }
  sum = block_sum(sum);
  const float inv = rsqrtf(sum / static_cast<float>(n) + eps);
  if (threadIdx.x == 0) rstd[row] = inv;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) yr[i] = static_cast<T>(to_f(xr[i]) * inv * to_f(w[i]));
}

template <typename T, typename W>
__global__ void rms_norm_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, const W* __restrict__ w,
                                    const float* __restrict__ rstd, T* __restrict__ dx, float* __restrict__ dw_rows,
                                    int64_t n) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * n;
  const T* gr = dy + row * n;
  const float inv = rstd[row];
  float dot = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dot += to_f(gr[i]) * to_f(w[i]) * to_f(xr[i]) * inv;
  dot = block_sum(dot) / static_cast<float>(n);
  T* dxr = dx + row * n;
  float* dwr = dw_rows + row * n;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float xhat = to_f(xr[i]) * inv;
    const float g = to_f(gr[i]);
    dxr[i] = static_cast<T>(inv * (g * to_f(w[i]) - xhat * dot));
    dwr[i] = g * xhat;
  }
}

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  TORCH_CHECK(x_in.size(-1) == w_in.numel(), "rms_norm: weight size does not match the hidden size");
  const c10::cuda::CUDAGuard guard(x_in.device());
  auto x = x_in.contiguous();
  auto w = w_in.contiguous();
  const int64_t n = x.size(-1);
  const int64_t rows = n ? x.numel() / n : 0;
  auto y = at::empty_like(x);
  auto rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  if (rows == 0) return {y, rstd};
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm_fwd", [&] {
    using T = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w.scalar_type(), "rms_norm_fwd_w", [&] {
      rms_norm_fwd_kernel<T, scalar_t><<<rows, kThreads, 0, stream>>>(
          x.data_ptr<T>(), w.data_ptr<scalar_t>(), y.data_ptr<T>(), rstd.data_ptr<float>(), n,
          static_cast<float>(eps));
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& dy_in, const at::Tensor& x_in, const at::Tensor& w_in,
                                                const at::Tensor& rstd) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  auto dy = dy_in.contiguous();
  auto x = x_in.contiguous();
  auto w = w_in.contiguous();
  const int64_t n = x.size(-1);
  const int64_t rows = n ? x.numel() / n : 0;
  auto dx = at::empty_like(x);
  auto dw_rows = at::empty({rows, n}, x.options().dtype(at::kFloat));
  if (rows > 0) {
    auto stream = c10::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm_bwd", [&] {
      using T = scalar_t;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w.scalar_type(), "rms_norm_bwd_w", [&] {
        rms_norm_bwd_kernel<T, scalar_t><<<rows, kThreads, 0, stream>>>(
            dy.data_ptr<T>(), x.data_ptr<T>(), w.data_ptr<scalar_t>(), rstd.data_ptr<float>(), dx.data_ptr<T>(),
            dw_rows.data_ptr<float>(), n);
      });
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {dx, dw_rows.sum(0).to(w.scalar_type())};
}

template <typename T>
__global__ void swiglu_fwd_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int64_t n) {
  const int64_t total = rows * n;
  for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < total;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = idx / n, i = idx % n;
    const float a = to_f(x[r * 2 * n + i]);
    const float b = to_f(x[r * 2 * n + n + i]);
    y[idx] = static_cast<T>(a / (1.f + __expf(-a)) * b);
  }
}

template <typename T>
__global__ void swiglu_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx,
                                  int64_t rows, int64_t n) {
  const int64_t total = rows * n;
  for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < total;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = idx / n, i = idx % n;
    const float a = to_f(x[r * 2 * n + i]);
    const float b = to_f(x[r * 2 * n + n + i]);
    const float g = to_f(dy[idx]);
    const float sig = 1.f / (1.f + __expf(-a));
    dx[r * 2 * n + i] = static_cast<T>(g * b * sig * (1.f + a * (1.f - sig)));
    dx[r * 2 * n + n + i] = static_cast<T>(g * a * sig);
  }
}

int blocks_for(int64_t total) {
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  return static_cast<int>(std::min<int64_t>(std::max<int64_t>(blocks, 1), 65535 * 8));
}

at::Tensor swiglu_fwd(const at::Tensor& x_in) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  auto x = x_in.contiguous();
  const int64_t n2 = x.size(-1);
  TORCH_CHECK(n2 % 2 == 0, "swiglu: last dimension must be even");
  const int64_t n = n2 / 2, rows = n2 ? x.numel() / n2 : 0;
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto y = at::empty(sizes, x.options());
  if (rows * n == 0) return y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "swiglu_fwd", [&] {
    swiglu_fwd_kernel<scalar_t><<<blocks_for(rows * n), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), rows, n);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

at::Tensor swiglu_bwd(const at::Tensor& dy_in, const at::Tensor& x_in) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  auto x = x_in.contiguous();
  auto dy = dy_in.contiguous();
  const int64_t n2 = x.size(-1), n = n2 / 2, rows = n2 ? x.numel() / n2 : 0;
  auto dx = at::empty_like(x);
  if (rows * n == 0) return dx;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "swiglu_bwd", [&] {
    swiglu_bwd_kernel<scalar_t><<<blocks_for(rows * n), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        dy.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), dx.data_ptr<scalar_t>(), rows, n);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return dx;
}

// One thread per rotated pair; channels past `rot` are copied.
template <typename T>
__global__ void rope_kernel(const T* __restrict__ t, const float* __restrict__ freqs, T* __restrict__ out,
                            int64_t s, int64_t bh, int64_t d, int64_t rot, bool broadcast_s, bool interleaved,
                            bool backward) {
  const int64_t total = s * bh * d;
  const int64_t half = rot / 2;
  for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < total;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int64_t k = idx % d;
    const int64_t row = idx / d;
    const int64_t si = row / bh;
    if (k >= rot) {
      out[idx] = t[idx];
      continue;
    }
    const bool first = interleaved ? (k % 2 == 0) : (k < half);
    if (!first) continue;
    const int64_t i0 = k, i1 = interleaved ? k + 1 : k + half;
    const float* f = freqs + (broadcast_s ? 0 : si * rot);
    float s0, c0, s1, c1;
    __sincosf(f[i0], &s0, &c0);
    __sincosf(f[i1], &s1, &c1);
    const float x0 = to_f(t[row * d + i0]), x1 = to_f(t[row * d + i1]);
    if (backward) {
      out[row * d + i0] = static_cast<T>(x0 * c0 + x1 * s1);
      out[row * d + i1] = static_cast<T>(x1 * c1 - x0 * s0);
    } else {
      out[row * d + i0] = static_cast<T>(x0 * c0 - x1 * s0);
      out[row * d + i1] = static_cast<T>(x1 * c1 + x0 * s1);
    }
  }
}

at::Tensor rope_apply(const at::Tensor& t_in, const at::Tensor& freqs_in, bool interleaved, bool backward) {
  TORCH_CHECK(t_in.dim() == 4, "rotary_pos_emb: expected [s, b, h, d]");
  const c10::cuda::CUDAGuard guard(t_in.device());
  auto t = t_in.contiguous();
  auto freqs = freqs_in.to(at::kFloat).contiguous();
  const int64_t s = t.size(0), bh = t.size(1) * t.size(2), d = t.size(3), rot = freqs.size(-1);
  TORCH_CHECK(rot <= d && rot % 2 == 0, "rotary_pos_emb: rotary dim must be even and <= head dim");
  auto out = at::empty_like(t);
  if (t.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t.scalar_type(), "rotary_pos_emb", [&] {
    rope_kernel<scalar_t><<<blocks_for(t.numel()), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        t.data_ptr<scalar_t>(), freqs.data_ptr<float>(), out.data_ptr<scalar_t>(), s, bh, d, rot,
        freqs.size(0) == 1, interleaved, backward);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor rope_fwd(const at::Tensor& t, const at::Tensor& freqs, bool interleaved) {
  return rope_apply(t, freqs, interleaved, false);
}

at::Tensor rope_bwd(const at::Tensor& dy, const at::Tensor& freqs, bool interleaved) {
  return rope_apply(dy, freqs, interleaved, true);
}

}  // namespace

TORCH_LIBRARY_IMPL(mm_adaptor, CUDA, m) {
  m.impl("rms_norm_fwd", &rms_norm_fwd);
  m.impl("rms_norm_bwd", &rms_norm_bwd);
  m.impl("swiglu_fwd", &swiglu_fwd);
  m.impl("swiglu_bwd", &swiglu_bwd);
  m.impl("rotary_pos_emb_fwd", &rope_fwd);
  m.impl("rotary_pos_emb_bwd", &rope_bwd);
}
