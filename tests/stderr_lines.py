"""What a subprocess printed on stderr, less the one line torch itself logs on a machine with nvcc but no GPU
(a CUDA build of torch, as pip gives Python 3.12, when megatron-core 0.17+ imports torch.utils.cpp_extension)."""

TORCH_NO_CUDA_RUNTIME = "torch/utils/cpp_extension.py:178] No CUDA runtime is found"


def without_torch_notes(stderr: str) -> str:
    return "".join(line for line in stderr.splitlines(keepends=True) if TORCH_NO_CUDA_RUNTIME not in line)
