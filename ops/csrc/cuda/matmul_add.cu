// main_grad (fp32) += grad_output^T @ input on CUDA: cuBLAS through ATen's addmm with an fp32 output dtype,
// so bf16/fp16 inputs are read as they are (fp32 accumulation, no fp32 copies of the inputs).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace {

void matmul_add_fp32_cuda(at::Tensor& main_grad, const at::Tensor& grad_output, const at::Tensor& input) {
  TORCH_CHECK(main_grad.scalar_type() == at::kFloat, "matmul_add_fp32: main_grad must be float32");
  TORCH_CHECK(grad_output.scalar_type() == input.scalar_type(), "matmul_add_fp32: grad_output and input dtypes differ");
  const c10::cuda::CUDAGuard guard(main_grad.device());
  const int64_t out = grad_output.size(-1), in = input.size(-1);
  auto go = grad_output.reshape({-1, out});
  auto x = input.reshape({-1, in});
  TORCH_CHECK(x.size(0) == go.size(0) && main_grad.size(0) == out && main_grad.size(1) == in,
              "matmul_add_fp32: shapes do not fit");
  if (go.size(0) == 0) return;
  if (x.scalar_type() == at::kFloat) {
    main_grad.addmm_(go.t(), x);
  } else if (x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16) {
    at::addmm_out(main_grad, main_grad, go.t(), x, at::kFloat, /*beta=*/1, /*alpha=*/1);
  } else {  // float64: addmm's out_dtype takes only fp16/bf16 to fp32; the product in float64, rounded once
    main_grad.add_(at::mm(go.t(), x).to(at::kFloat));
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(mm_adaptor, CUDA, m) {
  m.impl("matmul_add_fp32", &matmul_add_fp32_cuda);
}
