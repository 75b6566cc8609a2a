// host_mapped_copy on CUDA: pinned host memory mapped into the device address space (cudaHostAllocMapped), wrapped
// as a CUDA tensor whose deleter frees it with cudaFreeHost, holding a copy of src. Device kernels (e.g. Adam)
// then read and write it in place over the interconnect.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

namespace {

void check(cudaError_t status, const char* what) {
  TORCH_CHECK(status == cudaSuccess, "host_mapped_copy: ", what, ": ", cudaGetErrorString(status));
}

at::Tensor host_mapped_copy_cuda(const at::Tensor& src) {
  const c10::cuda::CUDAGuard guard(src.device());
  auto contiguous = src.contiguous();
  const size_t nbytes = contiguous.numel() * contiguous.element_size();
  void* host = nullptr;
  check(cudaHostAlloc(&host, nbytes > 0 ? nbytes : 1, cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc");
  void* device = nullptr;
  const auto mapped = cudaHostGetDevicePointer(&device, host, 0);
  if (mapped != cudaSuccess) {
    cudaFreeHost(host);
    check(mapped, "cudaHostGetDevicePointer (the device cannot map host memory)");
  }
  auto out = at::from_blob(
      device, contiguous.sizes(), contiguous.strides(), [host](void*) { cudaFreeHost(host); },
      contiguous.options());
  if (nbytes > 0) {
    const auto stream = c10::cuda::getCurrentCUDAStream();
    check(cudaMemcpyAsync(device, contiguous.data_ptr(), nbytes, cudaMemcpyDefault, stream), "cudaMemcpyAsync");
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(mm_adaptor, CUDA, m) {
  m.impl("host_mapped_copy", &host_mapped_copy_cuda);
}
