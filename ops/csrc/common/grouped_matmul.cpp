// MoE grouped matmul on ATen GEMMs (MKL/oneDNN on the CPU, cuBLAS on CUDA): device-generic code, compiled
// into each device's library and registered for that library's dispatch key (the builder defines
// MM_ADAPTOR_DISPATCH_KEY), so every device that has a native library has this op too.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#ifndef MM_ADAPTOR_DISPATCH_KEY
#error "MM_ADAPTOR_DISPATCH_KEY (CPU or CUDA) is defined by mm_adaptor's builder"
#endif

namespace {

std::vector<int64_t> expert_counts(const at::Tensor& tokens_per_expert, int64_t experts, int64_t tokens) {
  auto counts = tokens_per_expert.to(at::kCPU, at::kLong).contiguous();
  TORCH_CHECK(counts.numel() == experts, "grouped_matmul: tokens_per_expert has ", counts.numel(),
              " entries for ", experts, " experts");
  std::vector<int64_t> result(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + experts);
  int64_t total = 0;
  for (auto c : result) {
    TORCH_CHECK(c >= 0, "grouped_matmul: negative token count ", c);
    total += c;
  }
  TORCH_CHECK(total == tokens, "grouped_matmul: tokens_per_expert sums to ", total, " but x has ", tokens, " rows");
  return result;
}

// x[T, in] (rows sorted by expert), w[E, in, out] -> y[T, out]
at::Tensor grouped_matmul_fwd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& tokens_per_expert) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && x.size(1) == w.size(1), "grouped_matmul: x ", x.sizes(),
              " and weights ", w.sizes(), " do not fit ([T, in] and [E, in, out])");
  auto counts = expert_counts(tokens_per_expert, w.size(0), x.size(0));
  auto y = at::empty({x.size(0), w.size(2)}, x.options());
  int64_t start = 0;
  for (int64_t e = 0; e < w.size(0); ++e) {
    if (counts[e] > 0) {
      auto ye = y.narrow(0, start, counts[e]);
      at::mm_out(ye, x.narrow(0, start, counts[e]), w[e]);
    }
    start += counts[e];
  }
  return y;
}

std::tuple<at::Tensor, at::Tensor> grouped_matmul_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                                      const at::Tensor& tokens_per_expert) {
  auto counts = expert_counts(tokens_per_expert, w.size(0), x.size(0));
  auto dx = at::empty_like(x);
  auto dw = at::empty_like(w);  // every slice is written below; zero-filling it all costs a pass over dw
  int64_t start = 0;
  for (int64_t e = 0; e < w.size(0); ++e) {
    if (counts[e] == 0) {
      dw[e].zero_();  // an expert without tokens gets a zero gradient
    } else {
      auto dye = dy.narrow(0, start, counts[e]);
      auto dxe = dx.narrow(0, start, counts[e]);
      at::mm_out(dxe, dye, w[e].t());
      auto dwe = dw[e];
      at::mm_out(dwe, x.narrow(0, start, counts[e]).t(), dye);
    }
    start += counts[e];
  }
  return {dx, dw};
}

}  // namespace

TORCH_LIBRARY_IMPL(mm_adaptor, MM_ADAPTOR_DISPATCH_KEY, m) {
  m.impl("grouped_matmul_fwd", &grouped_matmul_fwd);
  m.impl("grouped_matmul_bwd", &grouped_matmul_bwd);
}
