"""Model-state memory accounting (mm_adaptor.devices.memory.model_state_bytes) against bytes computed by hand."""

import pytest
import torch
from torch import nn

from mm_adaptor.devices.memory import model_state_bytes


def kinds(figures):
    return {k: figures[k] for k in ("parameter_bytes", "gradient_bytes", "optimizer_main_param_bytes",
                                    "optimizer_moment_bytes")}


def test_plain_module_with_gradients_and_adam():
    model = nn.Linear(8, 4)  # 32 + 4 fp32 values
    model(torch.randn(3, 8)).sum().backward()
    opt = torch.optim.Adam(model.parameters())
    opt.step()
    figures = model_state_bytes([model], opt, device="cpu")
    assert kinds(figures) == {"parameter_bytes": 144, "gradient_bytes": 144, "optimizer_main_param_bytes": 0,
                              "optimizer_moment_bytes": 2 * 144}  # the optimizer's params are the model's
    assert figures["optimizer_state_bytes"] == 288
    assert figures["device_bytes"] == 144 * 4 and figures["host_bytes"] == 0


def test_a_weight_tied_across_modules_counts_once():
    embedding = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight
    assert model_state_bytes([embedding, head], device="cpu")["parameter_bytes"] == 10 * 4 * 4


def test_views_of_one_buffer_count_their_own_bytes():
    buffer = torch.zeros(100)
    model = nn.Module()
    model.a = nn.Parameter(buffer[0:30].view(5, 6))
    model.b = nn.Parameter(buffer[30:70])
    # Each view counts once (not the whole buffer, not only the first view); the unused tail is not counted.
    assert model_state_bytes([model], device="cpu")["parameter_bytes"] == 70 * 4


def test_overlapping_views_do_not_double_count():
    buffer = torch.zeros(100)
    model = nn.Module()
    model.a = nn.Parameter(buffer[0:30])
    model.b = nn.Parameter(buffer[20:50])
    model.c = nn.Parameter(buffer[60:61])
    assert model_state_bytes([model], device="cpu")["parameter_bytes"] == (50 + 1) * 4


def test_main_params_count_only_where_they_are_separate_copies():
    bf16 = nn.Linear(16, 16, bias=False).to(torch.bfloat16)  # 256 values
    main = [bf16.weight.detach().float().requires_grad_()]
    main[0].grad = torch.zeros_like(main[0])
    opt = torch.optim.Adam(main)
    opt.step()
    figures = model_state_bytes([bf16], opt, device="cpu")
    assert kinds(figures) == {"parameter_bytes": 256 * 2, "gradient_bytes": 256 * 4,
                              "optimizer_main_param_bytes": 256 * 4, "optimizer_moment_bytes": 2 * 256 * 4}

    fp32 = nn.Linear(16, 16, bias=False)
    views = [fp32.weight.detach().view(-1)[:128], fp32.weight.detach().view(-1)[128:]]  # shards, as megatron's
    opt = torch.optim.Adam([v.requires_grad_() for v in views])                     # distributed optimizer holds
    assert model_state_bytes([fp32], opt, device="cpu")["optimizer_main_param_bytes"] == 0


def test_host_residence_when_the_model_runs_on_an_accelerator():
    model = nn.Linear(8, 4)
    on_cpu_backend = model_state_bytes([model], device="cpu")
    assert on_cpu_backend["device_bytes"] == 144 and on_cpu_backend["host_bytes"] == 0
    parked = model_state_bytes([model], device="cuda")  # CPU tensors of a model that computes on a GPU
    assert parked["host_bytes"] == 144 and parked["device_bytes"] == 0
    assert parked["by_residence"]["host"]["parameter_bytes"] == parked["parameter_bytes"] == 144


def build_tiny_gpt(argv):
    from megatron.core import tensor_parallel

    from mm_adaptor.harness.runner.arguments import finalize_args, parse_args
    from mm_adaptor.harness.runner.model import build_model, build_optimizer, transformer_config, wrap_model

    args = finalize_args(parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                                     "--vocab-size", "128", "--seq-length", "16", *argv]), 1)
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    config = transformer_config(args)
    model = wrap_model(args, config, build_model(args, config, torch.device("cpu")))
    optimizer, _ = build_optimizer(args, config, model)
    return model, optimizer


@pytest.mark.parametrize("argv", [[], ["--use-distributed-optimizer"], ["--bf16"],
                                  ["--bf16", "--use-distributed-optimizer"]],
                         ids=["fp32", "fp32-distopt", "bf16", "bf16-distopt"])
def test_megatron_ddp_tiny_gpt(single_rank_megatron, argv):
    from mm_adaptor.core.wrapped import unwrap

    model, optimizer = build_tiny_gpt(argv)
    h, layers, vocab, seq = 32, 2, 128, 16
    # tied embedding/output weight + learned positions + per layer (LayerNorms, QKV, projection, MLP; all with
    # biases) + the final LayerNorm
    n = vocab * h + seq * h + layers * (12 * h * h + 13 * h) + 2 * h
    assert sum(p.numel() for p in unwrap(model[0]).parameters()) == n
    model[0].zero_grad_buffer()
    assert optimizer.step()[0]  # zero gradients; creates Adam's moments
    bf16 = "--bf16" in argv
    expected = {
        "parameter_bytes": n * (2 if bf16 else 4),  # views of DDP's buffer with the distributed optimizer
        "gradient_bytes": n * 4,  # DDP's fp32 main_grad buffer (grad_reduce_in_fp32)
        "optimizer_main_param_bytes": n * 4 if bf16 else 0,  # fp32 runs: the model params (or views of them)
        "optimizer_moment_bytes": 2 * n * 4,  # exp_avg, exp_avg_sq (all of them: one data-parallel rank)
    }
    figures = model_state_bytes(model, optimizer)
    assert kinds(figures) == expected
    assert figures["optimizer_state_bytes"] == expected["optimizer_main_param_bytes"] + 2 * n * 4
    assert figures["device_bytes"] == sum(expected.values()) and figures["host_bytes"] == 0


def test_report_splits_a_kind_by_residence_only_where_some_is_in_host_memory():
    from mm_adaptor.harness.report import _model_state_rows

    model = nn.Linear(8, 4)
    off = model_state_bytes([model], device="cpu")
    on = model_state_bytes([model], device="cuda")
    rows = {label: (a, b) for label, a, b in _model_state_rows(off, on)}
    assert rows["parameters, on device"] == (144, 0) and rows["parameters, in host memory"] == (0, 144)
    assert rows["gradients (main_grad)"] == (0, 0) and rows["model state in host memory"] == (0, 144)
    assert "model state in host memory" not in dict((r[0], r) for r in _model_state_rows(off, off))
