// Shared pieces of the bandwidth-bound CUDA kernels: 16-byte packs, warp/block sums, launch sizing.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace mm_adaptor_cuda {

// N elements moved as one load/store (16 bytes at the widest); the pointer must be aligned to the pack.
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <int N, typename T>
__device__ __forceinline__ Pack<T, N> load(const T* p) {
  return *reinterpret_cast<const Pack<T, N>*>(p);
}

template <int N, typename T>
__device__ __forceinline__ void store(T* p, const Pack<T, N>& value) {
  *reinterpret_cast<Pack<T, N>*>(p) = value;
}

// fp32 accumulation, except float64 inputs which accumulate in float64 (as the references do).
template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T>
constexpr int pack_width() {
  return static_cast<int>(16 / sizeof(T));
}

__device__ __forceinline__ float rsqrt_acc(float v) {
  return rsqrtf(v);
}
__device__ __forceinline__ double rsqrt_acc(double v) {
  return rsqrt(v);
}

template <typename A>
__device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over a block of whole warps (blockDim.x a multiple of 32, at most 1024); safe to call in a loop.
template <typename A>
__device__ __forceinline__ A block_sum(A v) {
  __shared__ A partial[32];
  __shared__ A total;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (blockDim.x <= 32) return v;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x >> 5) ? partial[lane] : A(0);
    v = warp_sum(v);
    if (lane == 0) total = v;
  }
  __syncthreads();
  return total;
}

inline bool aligned_to(const void* p, int64_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

inline int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

inline int round_up_to_warp(int64_t threads) {
  return static_cast<int>(std::max<int64_t>(32, ceil_div(threads, 32) * 32));
}

inline int sm_count() {
  int device = 0, count = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

// Blocks that fill the device once at full occupancy (for kernels that loop over rows).
template <typename Kernel>
int64_t resident_blocks(Kernel kernel, int threads) {
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
  return static_cast<int64_t>(std::max(per_sm, 1)) * sm_count();
}

constexpr int64_t kMaxGridX = 2147483647;
constexpr int64_t kMaxGridY = 65535;

}  // namespace mm_adaptor_cuda
