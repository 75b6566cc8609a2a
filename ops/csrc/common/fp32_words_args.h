// Argument checks shared by every device's split_fp32_words / join_fp32_words.
#pragma once

#include <ATen/ATen.h>

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

}  // namespace mm_adaptor::fp32_words
