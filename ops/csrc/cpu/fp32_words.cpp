// split_fp32_words / join_fp32_words on the CPU: one fused pass each way over blocks of words. The multi-tensor
// forms (round_split_fp32_words, join_fp32_words_multi) take a whole batch of parameters in one call: one parallel
// loop over the blocks of every tensor; round_split also writes the bf16 model values (megatron's copy) from the
// words it reads, so each word is read once.
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../common/fp32_words_args.h"
#include "common.h"

namespace {

using namespace mm_adaptor::cpu;

// a block with a word outside int16 is scanned again for its positions
constexpr int64_t kWordBlock = 4096;

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
  const int64_t blocks = (n + kWordBlock - 1) / kWordBlock;
  std::vector<std::vector<int64_t>> outside(blocks);
  at::parallel_for(0, blocks, std::max<int64_t>(1, kMinTaskElements / kWordBlock), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t lo = b * kWordBlock, hi = std::min(n, lo + kWordBlock);
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

constexpr uint16_t kCpuNanBits = 0xffff;  // what torch's vectorised (AVX2/AVX-512) fp32 -> bf16 copy writes for a NaN

// The blocks of every tensor, numbered in order: tensor t owns blocks [first[t], first[t + 1]).
std::vector<int64_t> first_blocks(at::TensorList tensors) {
  std::vector<int64_t> first(tensors.size() + 1, 0);
  for (size_t t = 0; t < tensors.size(); ++t)
    first[t + 1] = first[t] + (tensors[t].numel() + kWordBlock - 1) / kWordBlock;
  return first;
}

size_t owner_of(const std::vector<int64_t>& first, int64_t block) {
  return static_cast<size_t>(std::upper_bound(first.begin(), first.end(), block) - first.begin() - 1);
}

// For each tensor t: with round_model, models[t] = the words rounded to bf16 (nearest, ties to even: megatron's
// copy); then residuals[t] as split_fp32_words, the first capacity exceptions (ascending) in indices[t] / kept[t]
// (the rest -1 and 0) and their number in counts[t].
void round_split_fp32_words(at::TensorList mains, at::TensorList models, at::TensorList residuals,
                            at::TensorList indices, at::TensorList kept, const at::Tensor& counts, bool round_model) {
  namespace fw = mm_adaptor::fp32_words;
  fw::check_multi_split_args(mains, models, residuals, indices, kept, counts);
  const auto first = first_blocks(mains);
  const int64_t blocks = first.back();
  std::vector<std::vector<int64_t>> outside(blocks);
  at::parallel_for(0, blocks, std::max<int64_t>(1, kMinTaskElements / kWordBlock), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const size_t t = owner_of(first, b);
      const int64_t n = mains[t].numel(), lo = (b - first[t]) * kWordBlock, hi = std::min(n, lo + kWordBlock);
      const auto* words = reinterpret_cast<const uint32_t*>(mains[t].data_ptr());
      auto* highs = reinterpret_cast<uint16_t*>(models[t].data_ptr());
      auto* res = residuals[t].data_ptr<int16_t>();
      int32_t any = 0;
      if (round_model) {
        for (int64_t i = lo; i < hi; ++i) {
          const uint32_t u = words[i];
          const uint16_t h = fw::is_nan_word(u) ? kCpuNanBits : fw::round_to_bf16_bits(u);
          highs[i] = h;
          const int64_t diff = static_cast<int64_t>(static_cast<int32_t>(u)) -
                               static_cast<int64_t>(static_cast<int16_t>(h)) * 65536;
          any |= (diff < INT16_MIN) | (diff > INT16_MAX);
          res[i] = static_cast<int16_t>(std::clamp<int64_t>(diff, INT16_MIN, INT16_MAX));
        }
      } else {
        for (int64_t i = lo; i < hi; ++i) {
          const int64_t diff = static_cast<int64_t>(static_cast<int32_t>(words[i])) -
                               static_cast<int64_t>(static_cast<int16_t>(highs[i])) * 65536;
          any |= (diff < INT16_MIN) | (diff > INT16_MAX);
          res[i] = static_cast<int16_t>(std::clamp<int64_t>(diff, INT16_MIN, INT16_MAX));
        }
      }
      if (!any) continue;
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t diff = static_cast<int64_t>(static_cast<int32_t>(words[i])) -
                             static_cast<int64_t>(static_cast<int16_t>(highs[i])) * 65536;
        if (diff < INT16_MIN || diff > INT16_MAX) outside[b].push_back(i);
      }
    }
  });
  auto* count_of = counts.data_ptr<int64_t>();
  for (size_t t = 0; t < mains.size(); ++t) {
    const int64_t capacity = indices[t].numel();
    const auto* words = reinterpret_cast<const int32_t*>(mains[t].data_ptr());
    auto* at_index = indices[t].data_ptr<int64_t>();
    auto* kept_words = kept[t].data_ptr<int32_t>();
    int64_t count = 0;
    for (int64_t b = first[t]; b < first[t + 1]; ++b) {
      for (const int64_t i : outside[b]) {
        if (count < capacity) {
          at_index[count] = i;
          kept_words[count] = words[i];
        }
        ++count;
      }
    }
    std::fill(at_index + std::min(count, capacity), at_index + capacity, -1);
    std::fill(kept_words + std::min(count, capacity), kept_words + capacity, 0);
    count_of[t] = count;
  }
}

// outs[t] = models[t] << 16 + residuals[t], then the first min(counts[t], capacity) kept words at their positions.
void join_fp32_words_multi(at::TensorList models, at::TensorList residuals, at::TensorList indices,
                           at::TensorList kept, at::TensorList counts, at::TensorList outs) {
  mm_adaptor::fp32_words::check_multi_join_args(models, residuals, indices, kept, counts, outs);
  const auto first = first_blocks(outs);
  at::parallel_for(0, first.back(), std::max<int64_t>(1, kMinTaskElements / kWordBlock), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const size_t t = owner_of(first, b);
      const int64_t n = outs[t].numel(), lo = (b - first[t]) * kWordBlock, hi = std::min(n, lo + kWordBlock);
      const auto* highs = reinterpret_cast<const uint16_t*>(models[t].data_ptr());
      const auto* res = residuals[t].data_ptr<int16_t>();
      auto* words = reinterpret_cast<uint32_t*>(outs[t].data_ptr());
      for (int64_t i = lo; i < hi; ++i)
        words[i] = (static_cast<uint32_t>(highs[i]) << 16) + static_cast<uint32_t>(static_cast<int32_t>(res[i]));
    }
  });
  for (size_t t = 0; t < outs.size(); ++t) {
    const int64_t n = outs[t].numel();
    const int64_t listed = std::min(counts[t].data_ptr<int64_t>()[0], indices[t].numel());
    const auto* at_index = indices[t].data_ptr<int64_t>();
    const auto* kept_words = reinterpret_cast<const uint32_t*>(kept[t].data_ptr());
    auto* words = reinterpret_cast<uint32_t*>(outs[t].data_ptr());
    for (int64_t k = 0; k < listed; ++k) {
      TORCH_CHECK(at_index[k] >= 0 && at_index[k] < n, "join_fp32_words_multi: index ", at_index[k], " outside ", n,
                  " words");
      words[at_index[k]] = kept_words[k];
    }
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(mm_adaptor, CPU, m) {
  m.impl("split_fp32_words", &split_fp32_words);
  m.impl("join_fp32_words", &join_fp32_words);
  m.impl("round_split_fp32_words", &round_split_fp32_words);
  m.impl("join_fp32_words_multi", &join_fp32_words_multi);
}
