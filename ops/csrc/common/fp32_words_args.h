// Argument checks shared by every device's split_fp32_words / join_fp32_words.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace mm_adaptor::fp32_words {

inline void check_split_args(const at::Tensor& main, const at::Tensor& model, int64_t capacity) {
  TORCH_CHECK(capacity >= 0, "split_fp32_words: capacity ", capacity, " is negative");
  TORCH_CHECK(main.scalar_type() == at::kFloat && model.scalar_type() == at::kBFloat16,
              "split_fp32_words: fp32 words and bf16 high halves expected, got ", main.scalar_type(), " and ",
              model.scalar_type());
  TORCH_CHECK(main.numel() == model.numel(), "split_fp32_words: ", main.numel(), " words but ", model.numel(),
              " high halves");
}

inline void check_join_args(const at::Tensor& model, const at::Tensor& residual, const at::Tensor& index,
                            const at::Tensor& kept, const at::Tensor& out) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous(), "join_fp32_words: contiguous fp32 out expected");
  TORCH_CHECK(model.scalar_type() == at::kBFloat16 && residual.scalar_type() == at::kShort &&
                  index.scalar_type() == at::kLong && kept.scalar_type() == at::kInt,
              "join_fp32_words: bf16 high halves, int16 residuals, int64 index and int32 kept words expected");
  TORCH_CHECK(model.numel() == out.numel() && residual.numel() == out.numel() && index.numel() == kept.numel(),
              "join_fp32_words: sizes differ (out ", out.numel(), ", high halves ", model.numel(), ", residuals ",
              residual.numel(), ", index ", index.numel(), ", kept ", kept.numel(), ")");
}

// The multi-tensor forms: one call per batch of parameters. Every list holds one entry per tensor; each tensor is
// contiguous (a copy would lose what the op writes), the models bf16 and the words fp32 of the same numel, the
// residuals int16 of that numel, the exception lists int64 positions and int32 words of one capacity each.
inline void check_lists(const char* op, at::TensorList words, at::TensorList models, at::TensorList residuals,
                        at::TensorList indices, at::TensorList kept) {
  const size_t n = words.size();
  TORCH_CHECK(models.size() == n && residuals.size() == n && indices.size() == n && kept.size() == n, op,
              ": lists of different lengths (", n, " words, ", models.size(), " high halves, ", residuals.size(),
              " residuals, ", indices.size(), " indices, ", kept.size(), " kept)");
  for (size_t t = 0; t < n; ++t) {
    TORCH_CHECK(words[t].scalar_type() == at::kFloat && models[t].scalar_type() == at::kBFloat16 &&
                    residuals[t].scalar_type() == at::kShort && indices[t].scalar_type() == at::kLong &&
                    kept[t].scalar_type() == at::kInt,
                op, ": tensor ", t, ": fp32 words, bf16 high halves, int16 residuals, int64 indices and int32 kept "
                "words expected");
    TORCH_CHECK(words[t].is_contiguous() && models[t].is_contiguous() && residuals[t].is_contiguous() &&
                    indices[t].is_contiguous() && kept[t].is_contiguous(),
                op, ": tensor ", t, " is not contiguous");
    TORCH_CHECK(models[t].numel() == words[t].numel() && residuals[t].numel() == words[t].numel() &&
                    indices[t].numel() == kept[t].numel(),
                op, ": tensor ", t, ": sizes differ (words ", words[t].numel(), ", high halves ", models[t].numel(),
                ", residuals ", residuals[t].numel(), ", index ", indices[t].numel(), ", kept ", kept[t].numel(), ")");
    TORCH_CHECK(models[t].device() == words[t].device() && residuals[t].device() == words[t].device() &&
                    indices[t].device() == words[t].device() && kept[t].device() == words[t].device(),
                op, ": tensor ", t, " spans devices");
  }
}

inline void check_multi_split_args(at::TensorList mains, at::TensorList models, at::TensorList residuals,
                                   at::TensorList indices, at::TensorList kept, const at::Tensor& counts) {
  check_lists("round_split_fp32_words", mains, models, residuals, indices, kept);
  TORCH_CHECK(counts.scalar_type() == at::kLong && counts.is_contiguous() &&
                  counts.numel() == static_cast<int64_t>(mains.size()),
              "round_split_fp32_words: one contiguous int64 counter per tensor expected (", mains.size(),
              " tensors, ", counts.numel(), " counters)");
  TORCH_CHECK(mains.empty() || counts.device() == mains[0].device(), "round_split_fp32_words: counters on ",
              counts.device(), ", words on ", mains[0].device());
}

inline void check_multi_join_args(at::TensorList models, at::TensorList residuals, at::TensorList indices,
                                  at::TensorList kept, at::TensorList counts, at::TensorList outs) {
  check_lists("join_fp32_words_multi", outs, models, residuals, indices, kept);
  TORCH_CHECK(counts.size() == outs.size(), "join_fp32_words_multi: ", outs.size(), " tensors but ", counts.size(),
              " counters");
  for (size_t t = 0; t < counts.size(); ++t)
    TORCH_CHECK(counts[t].scalar_type() == at::kLong && counts[t].numel() == 1 && counts[t].device() == outs[t].device(),
                "join_fp32_words_multi: counter ", t, " is not one int64 on the words' device");
}

// fp32 -> bf16 rounding to nearest, ties to even, in integer arithmetic (exact for subnormals, infinities, -0.0, and
// independent of flush-to-zero): what torch's fp32 -> bf16 copy writes for every word but a NaN.
C10_HOST_DEVICE inline uint16_t round_to_bf16_bits(uint32_t u) {
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

C10_HOST_DEVICE inline bool is_nan_word(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }

}  // namespace mm_adaptor::fp32_words
