// split_fp32_words / join_fp32_words on CUDA: one fused pass each way. The split lists the words whose residual
// does not fit int16 (position and word) into buffers of `capacity` entries, one warp vote and atomic per warp,
// and counts them all in a device counter; nothing is read back to the host (the caller reads the counters of a
// whole batch at once, sorts the lists and splits again a tensor that overflowed).
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "../common/fp32_words_args.h"
#include "vectorized.cuh"

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ int64_t residual_of(int32_t word, int16_t high) {
  return static_cast<int64_t>(word) - static_cast<int64_t>(high) * 65536;
}

__device__ __forceinline__ bool outside_int16(int64_t diff) { return diff < -32768 || diff > 32767; }

__global__ void split_kernel(const int32_t* __restrict__ words, const int16_t* __restrict__ highs,
                             int16_t* __restrict__ residual, int64_t n, int64_t* __restrict__ index,
                             int32_t* __restrict__ kept, int64_t capacity, unsigned long long* __restrict__ count) {
  const unsigned lane = threadIdx.x & 31;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i - threadIdx.x < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    bool out = false;
    int32_t word = 0;
    if (i < n) {
      word = words[i];
      const int64_t diff = residual_of(word, highs[i]);
      out = outside_int16(diff);
      residual[i] = static_cast<int16_t>(diff < -32768 ? -32768 : (diff > 32767 ? 32767 : diff));
    }
    const unsigned votes = __ballot_sync(0xffffffffu, out);
    if (!votes) continue;
    unsigned long long base = 0;
    if (lane == 0) base = atomicAdd(count, static_cast<unsigned long long>(__popc(votes)));
    base = __shfl_sync(0xffffffffu, base, 0);
    if (out) {
      const auto slot = static_cast<int64_t>(base + __popc(votes & ((1u << lane) - 1u)));
      if (slot < capacity) {
        index[slot] = i;
        kept[slot] = word;
      }
    }
  }
}

__global__ void join_kernel(const uint16_t* __restrict__ highs, const int16_t* __restrict__ residual,
                            uint32_t* __restrict__ words, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    // wrapping arithmetic: exact wherever the word fits, and the kept words overwrite the others
    words[i] = (static_cast<uint32_t>(highs[i]) << 16) + static_cast<uint32_t>(static_cast<int32_t>(residual[i]));
  }
}

int blocks_for(int64_t n) {
  const int64_t blocks = std::min<int64_t>(mm_adaptor_cuda::ceil_div(n, kThreads), mm_adaptor_cuda::sm_count() * 8);
  return static_cast<int>(std::max<int64_t>(1, blocks));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> split_fp32_words_cuda(const at::Tensor& main_in,
                                                                                  const at::Tensor& model_in,
                                                                                  int64_t capacity) {
  mm_adaptor::fp32_words::check_split_args(main_in, model_in, capacity);
  const c10::cuda::CUDAGuard guard(main_in.device());
  const auto main = main_in.contiguous();
  const auto model = model_in.contiguous();
  const int64_t n = main.numel();
  auto residual = at::empty({n}, main.options().dtype(at::kShort));
  auto index = at::full({capacity}, -1, main.options().dtype(at::kLong));
  auto kept = at::zeros({capacity}, main.options().dtype(at::kInt));
  auto count = at::zeros({1}, main.options().dtype(at::kLong));
  if (n == 0) return {residual, index, kept, count};
  split_kernel<<<blocks_for(n), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const int32_t*>(main.data_ptr()), reinterpret_cast<const int16_t*>(model.data_ptr()),
      residual.data_ptr<int16_t>(), n, index.data_ptr<int64_t>(), kept.data_ptr<int32_t>(), capacity,
      reinterpret_cast<unsigned long long*>(count.data_ptr<int64_t>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {residual, index, kept, count};
}

void join_fp32_words_cuda(const at::Tensor& model, const at::Tensor& residual, const at::Tensor& index,
                          const at::Tensor& kept, const at::Tensor& out) {
  mm_adaptor::fp32_words::check_join_args(model, residual, index, kept, out);
  const int64_t n = out.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  const auto model_c = model.contiguous();
  const auto residual_c = residual.contiguous();
  join_kernel<<<blocks_for(n), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint16_t*>(model_c.data_ptr()), residual_c.data_ptr<int16_t>(),
      reinterpret_cast<uint32_t*>(out.data_ptr()), n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (index.numel() > 0) out.view(at::kInt).index_put_({index}, kept);
}

}  // namespace

TORCH_LIBRARY_IMPL(mm_adaptor, CUDA, m) {
  m.impl("split_fp32_words", &split_fp32_words_cuda);
  m.impl("join_fp32_words", &join_fp32_words_cuda);
}
