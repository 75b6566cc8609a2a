// GEMM ops: weight-gradient accumulation into an fp32 main_grad, and the MoE grouped matmul.
// Both lean on ATen's GEMMs (MKL/oneDNN on CPU); grouped_matmul is device-agnostic ATen code.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

namespace {

constexpr int64_t kTokenBlock = 2048;  // rows converted to fp32 at a time; bounds the temporary memory

// main_grad[out, in] += grad_output[..., out]^T @ input[..., in], accumulated in fp32.
void matmul_add_fp32_cpu(at::Tensor& main_grad, const at::Tensor& grad_output, const at::Tensor& input) {
  TORCH_CHECK(main_grad.scalar_type() == at::kFloat, "matmul_add_fp32: main_grad must be float32, got ",
              main_grad.scalar_type());
  const int64_t out = grad_output.size(-1), in = input.size(-1);
  TORCH_CHECK(main_grad.dim() == 2 && main_grad.size(0) == out && main_grad.size(1) == in,
              "matmul_add_fp32: main_grad is ", main_grad.sizes(), ", expected [", out, ", ", in, "]");
  auto go = grad_output.reshape({-1, out});
  auto x = input.reshape({-1, in});
  TORCH_CHECK(go.size(0) == x.size(0), "matmul_add_fp32: grad_output has ", go.size(0), " rows, input has ",
              x.size(0));
  if (go.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat) {
    main_grad.addmm_(go.t(), x);
    return;
  }
  const int64_t rows = go.size(0);
  for (int64_t start = 0; start < rows; start += kTokenBlock) {
    const int64_t len = std::min(kTokenBlock, rows - start);
    main_grad.addmm_(go.narrow(0, start, len).to(at::kFloat).t(), x.narrow(0, start, len).to(at::kFloat));
  }
}

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

TORCH_LIBRARY_IMPL(mm_adaptor, CPU, m) {
  m.impl("matmul_add_fp32", &matmul_add_fp32_cpu);
}

TORCH_LIBRARY_IMPL(mm_adaptor, CompositeExplicitAutograd, m) {
  m.impl("grouped_matmul_fwd", &grouped_matmul_fwd);
  m.impl("grouped_matmul_bwd", &grouped_matmul_bwd);
}
