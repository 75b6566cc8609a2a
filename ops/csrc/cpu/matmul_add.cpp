// Weight-gradient accumulation into an fp32 main_grad on ATen's GEMMs (MKL/oneDNN).
#include <ATen/ATen.h>
#include <torch/library.h>


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

}  // namespace

TORCH_LIBRARY_IMPL(mm_adaptor, CPU, m) {
  m.impl("matmul_add_fp32", &matmul_add_fp32_cpu);
}

