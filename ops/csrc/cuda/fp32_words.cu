// split_fp32_words / join_fp32_words on CUDA: one fused pass each way. The split lists the words whose residual
// does not fit int16 (position and word) into buffers of `capacity` entries, one warp vote and atomic per warp,
// and counts them all in a device counter; nothing is read back to the host (the caller reads the counters of a
// whole batch at once, sorts the lists and splits again a tensor that overflowed).
//
// The multi-tensor forms take a batch of parameters in one launch (round_split) or two (join: the residuals, then
// the listed exceptions): a table of every tensor's pointers and sizes, packed in pinned memory and copied to the
// device without a wait, and a grid over fixed-size chunks of all of them. Where a tensor's pointers are 16-byte
// aligned a thread moves 8 words per step (two 16-byte fp32 loads, one 16-byte bf16 and one 16-byte int16 store),
// else one at a time. round_split rounds each word to bf16 as torch's copy does (the same integer rounding; a NaN
// through c10::BFloat16, as torch converts it), so the model values are megatron's bit for bit.
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

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

// One tensor of a batch, as the multi-tensor kernels see it.
struct Slot {
  const uint32_t* words_in;  // round_split: the fp32 words; join: unused
  uint32_t* words_out;       // join: where the words go; round_split: unused
  uint16_t* highs;           // the bf16 model values (written by round_split with round_model)
  int16_t* residual;
  int64_t* index;
  int32_t* kept;
  unsigned long long* count;  // round_split: incremented per exception; join: read
  int64_t numel;
  int64_t capacity;
  int64_t first_chunk;       // chunks [first_chunk, next slot's first_chunk) are this tensor's
  int64_t aligned;           // every pointer 16-byte aligned: 8 words per access
};

constexpr int64_t kChunk = 8 * 1024;  // words per chunk (a multiple of 8)

__device__ __forceinline__ int slot_of(const Slot* slots, int n, int64_t chunk) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (slots[mid].first_chunk <= chunk) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ uint16_t round_word(uint32_t u) {
  if (mm_adaptor::fp32_words::is_nan_word(u)) return c10::BFloat16(__uint_as_float(u)).x;  // as torch's copy
  return mm_adaptor::fp32_words::round_to_bf16_bits(u);
}

__device__ __forceinline__ int16_t split_one(const Slot& s, int64_t i, uint32_t u, uint16_t h) {
  const int64_t diff = static_cast<int64_t>(static_cast<int32_t>(u)) - static_cast<int64_t>(static_cast<int16_t>(h)) * 65536;
  if (diff < -32768 || diff > 32767) {  // rare: a tie rounded down to even or a NaN
    const unsigned long long slot = atomicAdd(s.count, 1ULL);
    if (slot < static_cast<unsigned long long>(s.capacity)) {
      s.index[slot] = i;
      s.kept[slot] = static_cast<int32_t>(u);
    }
    return diff < 0 ? -32768 : 32767;
  }
  return static_cast<int16_t>(diff);
}

template <bool kRound>
__global__ void round_split_kernel(const Slot* __restrict__ slots, int n, int64_t chunks) {
  using mm_adaptor_cuda::Pack;
  for (int64_t chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
    const Slot s = slots[slot_of(slots, n, chunk)];
    const int64_t lo = (chunk - s.first_chunk) * kChunk, hi = min(s.numel, lo + kChunk);
    if (s.aligned) {
      const int64_t vector_end = lo + ((hi - lo) / 8) * 8;
      for (int64_t i = lo + threadIdx.x * 8; i < vector_end; i += blockDim.x * 8) {
        const auto a = mm_adaptor_cuda::load<4>(s.words_in + i);
        const auto b = mm_adaptor_cuda::load<4>(s.words_in + i + 4);
        Pack<uint16_t, 8> highs;
        if (!kRound) highs = mm_adaptor_cuda::load<8>(s.highs + i);
        Pack<int16_t, 8> res;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const uint32_t u = k < 4 ? a.v[k] : b.v[k - 4];
          if (kRound) highs.v[k] = round_word(u);
          res.v[k] = split_one(s, i + k, u, highs.v[k]);
        }
        if (kRound) mm_adaptor_cuda::store<8>(s.highs + i, highs);
        mm_adaptor_cuda::store<8>(s.residual + i, res);
      }
      for (int64_t i = vector_end + threadIdx.x; i < hi; i += blockDim.x) {
        const uint32_t u = s.words_in[i];
        const uint16_t h = kRound ? round_word(u) : s.highs[i];
        if (kRound) s.highs[i] = h;
        s.residual[i] = split_one(s, i, u, h);
      }
    } else {
      for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const uint32_t u = s.words_in[i];
        const uint16_t h = kRound ? round_word(u) : s.highs[i];
        if (kRound) s.highs[i] = h;
        s.residual[i] = split_one(s, i, u, h);
      }
    }
  }
}

__device__ __forceinline__ uint32_t joined(uint16_t high, int16_t residual) {
  // wrapping arithmetic: exact wherever the word fits, and the kept words overwrite the others
  return (static_cast<uint32_t>(high) << 16) + static_cast<uint32_t>(static_cast<int32_t>(residual));
}

__global__ void join_multi_kernel(const Slot* __restrict__ slots, int n, int64_t chunks) {
  using mm_adaptor_cuda::Pack;
  for (int64_t chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
    const Slot s = slots[slot_of(slots, n, chunk)];
    const int64_t lo = (chunk - s.first_chunk) * kChunk, hi = min(s.numel, lo + kChunk);
    int64_t start = lo;
    if (s.aligned) {
      const int64_t vector_end = lo + ((hi - lo) / 8) * 8;
      for (int64_t i = lo + threadIdx.x * 8; i < vector_end; i += blockDim.x * 8) {
        const auto highs = mm_adaptor_cuda::load<8>(s.highs + i);
        const auto res = mm_adaptor_cuda::load<8>(s.residual + i);
        Pack<uint32_t, 4> a, b;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          a.v[k] = joined(highs.v[k], res.v[k]);
          b.v[k] = joined(highs.v[k + 4], res.v[k + 4]);
        }
        mm_adaptor_cuda::store<4>(s.words_out + i, a);
        mm_adaptor_cuda::store<4>(s.words_out + i + 4, b);
      }
      start = vector_end;
    }
    for (int64_t i = start + threadIdx.x; i < hi; i += blockDim.x) s.words_out[i] = joined(s.highs[i], s.residual[i]);
  }
}

// After join_multi_kernel: each tensor's listed exceptions (the first min(count, capacity)) written back.
__global__ void join_exceptions_kernel(const Slot* __restrict__ slots, int n) {
  for (int t = blockIdx.x; t < n; t += gridDim.x) {
    const Slot s = slots[t];
    const long long listed = min(static_cast<long long>(s.capacity), static_cast<long long>(*s.count));
    for (long long k = threadIdx.x; k < listed; k += blockDim.x) {
      const int64_t i = s.index[k];
      if (i >= 0 && i < s.numel) s.words_out[i] = static_cast<uint32_t>(s.kept[k]);
    }
  }
}

bool aligned16(const void* p) { return mm_adaptor_cuda::aligned_to(p, 16); }

// The slots in pinned memory, copied to the device without a wait (the caching host allocator keeps the pinned
// block until the copy is done); returns the device table and the number of chunks.
std::pair<at::Tensor, int64_t> device_table(std::vector<Slot>& slots, const at::Device& device) {
  int64_t chunks = 0;
  for (auto& s : slots) {
    s.first_chunk = chunks;
    chunks += mm_adaptor_cuda::ceil_div(s.numel, kChunk);
  }
  const auto bytes = static_cast<int64_t>(slots.size() * sizeof(Slot));
  auto host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), slots.data(), bytes);
  return {host.to(device, /*non_blocking=*/true), chunks};
}

int chunk_blocks(int64_t chunks) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(chunks, mm_adaptor_cuda::sm_count() * 16)));
}

void round_split_fp32_words_cuda(at::TensorList mains, at::TensorList models, at::TensorList residuals,
                                 at::TensorList indices, at::TensorList kept, const at::Tensor& counts,
                                 bool round_model) {
  mm_adaptor::fp32_words::check_multi_split_args(mains, models, residuals, indices, kept, counts);
  if (mains.empty()) return;
  const c10::cuda::CUDAGuard guard(mains[0].device());
  std::vector<Slot> slots;
  auto* count = reinterpret_cast<unsigned long long*>(counts.data_ptr<int64_t>());
  for (size_t t = 0; t < mains.size(); ++t) {
    Slot s{};
    s.words_in = reinterpret_cast<const uint32_t*>(mains[t].data_ptr());
    s.highs = reinterpret_cast<uint16_t*>(models[t].data_ptr());
    s.residual = residuals[t].data_ptr<int16_t>();
    s.index = indices[t].data_ptr<int64_t>();
    s.kept = kept[t].data_ptr<int32_t>();
    s.count = count + t;
    s.numel = mains[t].numel();
    s.capacity = indices[t].numel();
    s.aligned = aligned16(s.words_in) && aligned16(s.highs) && aligned16(s.residual);
    if (s.numel > 0) slots.push_back(s);
  }
  if (slots.empty()) return;
  auto [table, chunks] = device_table(slots, mains[0].device());
  const auto* on_device = reinterpret_cast<const Slot*>(table.data_ptr());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  if (round_model) {
    round_split_kernel<true><<<chunk_blocks(chunks), kThreads, 0, stream>>>(on_device, static_cast<int>(slots.size()), chunks);
  } else {
    round_split_kernel<false><<<chunk_blocks(chunks), kThreads, 0, stream>>>(on_device, static_cast<int>(slots.size()), chunks);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void join_fp32_words_multi_cuda(at::TensorList models, at::TensorList residuals, at::TensorList indices,
                                at::TensorList kept, at::TensorList counts, at::TensorList outs) {
  mm_adaptor::fp32_words::check_multi_join_args(models, residuals, indices, kept, counts, outs);
  if (outs.empty()) return;
  const c10::cuda::CUDAGuard guard(outs[0].device());
  std::vector<Slot> slots;
  for (size_t t = 0; t < outs.size(); ++t) {
    Slot s{};
    s.words_out = reinterpret_cast<uint32_t*>(outs[t].data_ptr());
    s.highs = reinterpret_cast<uint16_t*>(models[t].data_ptr());
    s.residual = residuals[t].data_ptr<int16_t>();
    s.index = indices[t].data_ptr<int64_t>();
    s.kept = kept[t].data_ptr<int32_t>();
    s.count = reinterpret_cast<unsigned long long*>(counts[t].data_ptr<int64_t>());
    s.numel = outs[t].numel();
    s.capacity = indices[t].numel();
    s.aligned = aligned16(s.words_out) && aligned16(s.highs) && aligned16(s.residual);
    if (s.numel > 0) slots.push_back(s);
  }
  if (slots.empty()) return;
  auto [table, chunks] = device_table(slots, outs[0].device());
  const auto* on_device = reinterpret_cast<const Slot*>(table.data_ptr());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int n = static_cast<int>(slots.size());
  join_multi_kernel<<<chunk_blocks(chunks), kThreads, 0, stream>>>(on_device, n, chunks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  join_exceptions_kernel<<<std::min(n, 65535), kThreads, 0, stream>>>(on_device, n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(mm_adaptor, CUDA, m) {
  m.impl("split_fp32_words", &split_fp32_words_cuda);
  m.impl("join_fp32_words", &join_fp32_words_cuda);
  m.impl("round_split_fp32_words", &round_split_fp32_words_cuda);
  m.impl("join_fp32_words_multi", &join_fp32_words_multi_cuda);
}
