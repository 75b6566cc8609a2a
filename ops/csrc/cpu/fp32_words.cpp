// split_fp32_words / join_fp32_words on the CPU: one fused pass each way over blocks of words.
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../common/fp32_words_args.h"
#include "common.h"

namespace {

using namespace mm_adaptor::cpu;

constexpr int64_t kBlock = 4096;  // a block with a word outside int16 is scanned again for its positions

// The first `capacity` exceptions (ascending) with their words; the rest of both buffers -1 and 0; count: how many.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> split_fp32_words(const at::Tensor& main_in,
                                                                            const at::Tensor& model_in,
                                                                            int64_t capacity) {
  mm_adaptor::fp32_words::check_split_args(main_in, model_in, capacity);
  const auto main = main_in.contiguous();
  const auto model = model_in.contiguous();
  const int64_t n = main.numel();
  auto residual = at::empty({n}, main.options().dtype(at::kShort));
  const auto* words = reinterpret_cast<const int32_t*>(main.data_ptr());
  const auto* highs = reinterpret_cast<const int16_t*>(model.data_ptr());
  auto* res = residual.data_ptr<int16_t>();
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<std::vector<int64_t>> outside(blocks);
  at::parallel_for(0, blocks, std::max<int64_t>(1, kMinTaskElements / kBlock), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t lo = b * kBlock, hi = std::min(n, lo + kBlock);
      int32_t any = 0;
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t diff = static_cast<int64_t>(words[i]) - static_cast<int64_t>(highs[i]) * 65536;
        any |= (diff < INT16_MIN) | (diff > INT16_MAX);
        res[i] = static_cast<int16_t>(std::clamp<int64_t>(diff, INT16_MIN, INT16_MAX));
      }
      if (!any) continue;
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t diff = static_cast<int64_t>(words[i]) - static_cast<int64_t>(highs[i]) * 65536;
        if (diff < INT16_MIN || diff > INT16_MAX) outside[b].push_back(i);
      }
    }
  });
  auto index = at::full({capacity}, -1, main.options().dtype(at::kLong));
  auto kept = at::zeros({capacity}, main.options().dtype(at::kInt));
  auto* at_index = index.data_ptr<int64_t>();
  auto* kept_words = kept.data_ptr<int32_t>();
  int64_t count = 0;
  for (const auto& block : outside) {
    for (const int64_t i : block) {
      if (count < capacity) {
        at_index[count] = i;
        kept_words[count] = words[i];
      }
      ++count;
    }
  }
  return {residual, index, kept, at::full({1}, count, main.options().dtype(at::kLong))};
}

void join_fp32_words(const at::Tensor& model, const at::Tensor& residual, const at::Tensor& index,
                     const at::Tensor& kept, const at::Tensor& out) {
  mm_adaptor::fp32_words::check_join_args(model, residual, index, kept, out);
  const int64_t n = out.numel();
  const auto model_c = model.contiguous();
  const auto residual_c = residual.contiguous();
  const auto* highs = reinterpret_cast<const uint16_t*>(model_c.data_ptr());
  const auto* res = residual_c.data_ptr<int16_t>();
  auto* words = reinterpret_cast<uint32_t*>(out.data_ptr());
  at::parallel_for(0, n, kMinTaskElements, [&](int64_t begin, int64_t end) {
    // wrapping arithmetic: exact wherever the word fits, and the kept words overwrite the others
    for (int64_t i = begin; i < end; ++i)
      words[i] = (static_cast<uint32_t>(highs[i]) << 16) + static_cast<uint32_t>(static_cast<int32_t>(res[i]));
  });
  const auto index_c = index.contiguous();
  const auto kept_c = kept.contiguous();
  const auto* at_index = index_c.data_ptr<int64_t>();
  const auto* kept_words = reinterpret_cast<const uint32_t*>(kept_c.data_ptr());
  for (int64_t k = 0; k < index.numel(); ++k) {
    TORCH_CHECK(at_index[k] >= 0 && at_index[k] < n, "join_fp32_words: index ", at_index[k], " outside ", n, " words");
    words[at_index[k]] = kept_words[k];
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(mm_adaptor, CPU, m) {
  m.impl("split_fp32_words", &split_fp32_words);
  m.impl("join_fp32_words", &join_fp32_words);
}
