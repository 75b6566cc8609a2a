// Helpers shared by the CPU kernels: accumulation dtype, parallel grain, widening half/bf16 data to fp32.
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace mm_adaptor::cpu {

// A task gets at least this many elements: smaller tensors run on the calling thread, since waking OpenMP
// threads for a few thousand values costs more than the work (and far more when the cores are busy).
inline constexpr int64_t kMinTaskElements = 32768;

// Rows (of `row_elements` values each) per parallel_for task.
inline int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kMinTaskElements / std::max<int64_t>(row_elements, 1));
}

// Accumulation (and rstd/freqs) dtype: double for double inputs, float otherwise.
inline at::ScalarType acc_type(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// Half/bf16 data is widened into buffers of A (fp32 or fp64) and results narrowed back, each in a plain loop the
// compiler vectorises, so the arithmetic sees only A; for float data the buffers are skipped.
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

}  // namespace mm_adaptor::cpu
