"""The benchmark scripts still run (tiny sizes): each checks its native path against the compared one first.

The end-to-end run of Megatron-LM's pretrain_gpt.py needs a Megatron-LM checkout: set MM_ADAPTOR_MEGATRON_LM to
it (and MM_ADAPTOR_MEGATRON_LM_PYTHON to an interpreter with its Python needs, default this one)."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
_SERVER: list = []  # the process run_script forks from, started by its first call


def run_script(script, *args, timeout=600):
    """`python benchmarks/<script> args`, run as __main__ in a child forked from a process that imported torch,
    megatron-core and the trainer's modules once (as the trainer's ranks fork): ~5 s of CPU less per script."""
    if not _SERVER or _SERVER[0].poll() is not None:
        serve = f"import runpy; runpy.run_path({__file__!r}, run_name='benchmarks_server')['_serve']()"
        _SERVER[:] = [subprocess.Popen([sys.executable, "-c", serve], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True)]
    request = [str(BENCHMARKS / script), list(args), os.getcwd(), dict(os.environ), timeout]
    _SERVER[0].stdin.write(json.dumps(request) + "\n")
    _SERVER[0].stdin.flush()
    status, stdout, stderr = json.loads(_SERVER[0].stdout.readline() or '["no reply", "", ""]')
    assert status == 0, f"exit {status}\n{stdout[-3000:]}{stderr[-3000:]}"
    return stdout


@pytest.fixture(autouse=True, scope="module")
def _stop_server():
    yield
    for server in _SERVER:
        server.stdin.close()
        server.wait(timeout=60)
    _SERVER.clear()


def _serve():
    """The process scripts fork from: per request line, [exit status, stdout, stderr] of the script's run."""
    import functools
    import runpy

    replies = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_RDWR), 1)  # stray prints stay out of the replies
    sys.path[0] = str(BENCHMARKS)  # as for `python benchmarks/<script>`
    import mm_adaptor.ranks.preload  # noqa: F401  (what the trainer's ranks fork from)
    from _common import forked

    def as_main(script, args, cwd, env):
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [script, *args]
        runpy.run_path(script, run_name="__main__")

    for line in sys.stdin:
        *request, timeout = json.loads(line)
        replies.write(json.dumps(forked(functools.partial(as_main, *request), timeout)) + "\n")
        replies.flush()
    os._exit(0)  # no teardown over torch and megatron (2 s)


def table_rows(stdout):
    header, *rows = [line for line in stdout.splitlines() if line.startswith("| ")]
    return header, [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in rows]


def load_benchmark(name, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import _common
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script, args, rows", [
    ("moe_experts.py", ["--tokens", "64", "--hidden", "32", "--ffn", "16", "--experts", "2"], 4),
    ("vocab_parallel_ce.py", ["--tokens", "64", "--vocab-shard", "128", "--dtype", "float32", "--rounds", "1"], 3),
])
def test_benchmark_prints_its_table(script, args, rows):
    stdout = run_script(script, *args, "--min-run-time", "0.01")
    header, *measured = [line for line in stdout.splitlines() if line.startswith("| ")]
    assert len(measured) == rows and " ms " in header, stdout
    assert not any("nan" in line or "inf" in line for line in measured), stdout


def test_moe_overlap_benchmark_checks_bit_for_bit_and_reports_the_hidden_fraction():
    """EP2 over gloo, shared experts: the script stops unless every chunk count's output and gradients equal
    megatron's; then one row per configuration with its hidden fraction."""
    stdout = run_script("moe_overlap.py", "--tokens", "64", "--hidden", "32", "--ffn", "32", "--experts", "4",
                        "--shared-ffn", "32", "--chunks", "1,2", "--iters", "1", "--warmup", "0", "--start", "fork")
    header, rows = table_rows(stdout)
    assert "hidden fraction" in header and [row[0] for row in rows][1:] == [
        "--moe-alltoall-overlap-comm, 1 chunks", "--moe-alltoall-overlap-comm, 2 chunks"], stdout
    assert all(float(row[1]) > 0 for row in rows), stdout


# each `mm-adaptor train` forked from the script's process (its imports shared), without the fusions Megatron
# compiles at start (torch.compile: slow on a CPU)
TRAINER_RUNS = ["--start", "fork", "--train-args=--no-bias-swiglu-fusion --no-bias-dropout-fusion"]


def test_vlm_throughput_runs_the_trainer_and_the_transformers_peer():
    """The device benchmark's CPU size (gpu_session.sh vlm runs it on a device): the fused trainer run and the peer
    train, and the table holds their tokens/s, TFLOP/s, peak memory and ratios to the peer."""
    stdout = run_script("vlm_throughput.py", "--steps", "2", "--samples", "2", "--seq", "512", "--llm-layers", "1",
                        "--runs", "fused", *TRAINER_RUNS)  # the unfused run takes the same path
    header, rows = table_rows(stdout)
    assert [row[0] for row in rows] == ["mm-adaptor, fused", "transformers (peer)"], stdout
    for _, rate, tflops, with_vit, peak, loss, rate_ratio, peak_ratio in rows:
        assert float(rate) > 0 and 0 < float(tflops) < float(with_vit) and peak.endswith(" GiB"), stdout
        assert 0 < float(loss) < 20, stdout
        assert float(peak.split()[0]) > 0 and rate_ratio.endswith("x") and peak_ratio.endswith("x"), stdout
    assert rows[-1][-2:] == ["1.00x", "1.00x"], stdout


def test_lora_benchmark_compares_lora_with_full_fine_tuning():
    """Both runs train and save; LoRA's trainable share and optimizer state are below full fine-tuning's, in the
    same ratio (both are the trainable elements)."""
    stdout = run_script("lora.py", "--steps", "2", "--samples", "2", "--seq", "512", "--llm-layers", "1", "--r", "4",
                        *TRAINER_RUNS)
    header, rows = table_rows(stdout)
    assert [row[0] for row in rows] == ["full fine-tuning", "LoRA r 4", "LoRA / full"], stdout
    trainable, optimizer = (float(cell.rstrip("x")) for cell in rows[2][1:3])
    assert 0 < trainable < 0.5 and abs(optimizer - trainable) < 0.01, stdout


def test_vlm_throughput_counts_flops_per_token_and_image(monkeypatch):
    bench = load_benchmark("vlm_throughput", monkeypatch)
    hf = bench.model_config("cpu", 2)
    one_text, _ = bench.step_flops(hf, [(100, [])])
    two_text, _ = bench.step_flops(hf, [(100, []), (100, [])])
    longer, _ = bench.step_flops(hf, [(200, [])])
    assert two_text == 2 * one_text and 2 * one_text < longer < 4 * one_text  # attention grows with n^2
    language, vision = bench.step_flops(hf, [(100, [(1, 8, 8)])])
    assert language > one_text and vision > 0  # the projector trains; the tower's forward counted apart


def test_ops_benchmark_reports_bandwidth_of_every_implementation(monkeypatch):
    stdout = run_script("ops.py", "--tokens", "64", "--hidden", "64", "--dtype", "float32", "--min-run-time", "0.01",
                        "--copy-mib", "4", "--compile-backend", "aot_eager")  # inductor's CPU codegen: 15 s more
    copy = re.search(r"device-to-device copy of 4 MiB: ([\d.]+) GB/s", stdout)
    assert copy and float(copy.group(1)) > 0, stdout
    header, rows = table_rows(stdout)
    assert "GB/s" in header and "% of copy" in header, stdout
    impls = {"rms_norm": 5, "swiglu": 4, "rotary_pos_emb": 4}
    assert len(rows) == 2 * sum(impls.values()), stdout
    for op, count in impls.items():
        for label in ("fwd", "fwd+bwd"):
            assert len([r for r in rows if r[0] == op and r[3] == label]) == count, (op, label, stdout)

    bench = load_benchmark("ops", monkeypatch)
    shapes = {"rms_norm": (64, 64), "swiglu": (64, 64), "rotary_pos_emb": (32, 2, 1, 64)}
    for op, _dtype, _shape, label, impl, ms, gbs, percent, ratio in rows:
        if impl in ("mm_adaptor", "eager", "torch F.rms_norm") or (impl == "torch.compile"
                                                                     and not ms.startswith("compile failed")):
            expected = bench.MIN_BYTES[op](shapes[op], torch.float32)[label] / (float(ms) * 1e-3) / 1e9
            assert float(gbs) == pytest.approx(expected, rel=0.002), (op, impl, label, stdout)
            assert float(percent.rstrip("%")) == pytest.approx(100 * expected / float(copy.group(1)),
                                                               rel=0.005, abs=0.06)
            assert ratio.endswith("x") and (impl != "mm_adaptor" or ratio == "1.00x"), stdout
        elif impl == "liger":
            assert ms in ("not installed", "needs CUDA (Triton kernels)") or ms.startswith("import failed"), stdout
        else:
            pytest.fail(f"{op} {impl} {label}: {ms}")


def test_ops_benchmark_byte_formulas(monkeypatch):
    bench = load_benchmark("ops", monkeypatch)
    # x [2, 4] fp32: fwd reads x, w, writes y, rstd; bwd reads dy, x, w, rstd, writes dx, dw
    assert bench.rms_norm_min_bytes((2, 4), torch.float32) == {"fwd": 4 * (8 + 4 + 8) + 4 * 2,
                                                               "fwd+bwd": 88 + 4 * (8 + 8 + 4 + 8 + 4) + 4 * 2}
    # x [2, 2x3] bf16: fwd reads x (12), writes y (6); bwd reads dy (6), x (12), writes dx (12)
    assert bench.swiglu_min_bytes((2, 3), torch.bfloat16) == {"fwd": 2 * 18, "fwd+bwd": 2 * (18 + 30)}
    # t [2, 1, 1, 4] fp32 (8 elements), freqs [2, 4] fp32 read in both passes
    assert bench.rotary_pos_emb_min_bytes((2, 1, 1, 4), torch.float32) == {"fwd": 64 + 32, "fwd+bwd": 2 * 96}


MEGATRON_LOG = """\
 [2026-11-23 17:28:11.790010] iteration        1/       3 | consumed samples:            2 | elapsed time per \
iteration (ms): 953.0 | learning rate: 8.333334E-04 | global batch size:     2 | lm loss: 7.070902E+00 | loss scale: \
1.0 | grad norm: 1.848 | number of skipped iterations:   0 | number of nan iterations:   0 |
[mm-e2e] iteration 1 lm loss: 0x1.c4890c0000000p+2
[Rank 0] (after 1 iterations) memory (MB) | allocated: 100.00 | max allocated: 2048.00 | reserved: 0.00 | max \
reserved: 0.00
 [2026-11-23 17:28:11.889654] iteration        2/       3 | consumed samples:            4 | elapsed time per \
iteration (ms): 50.5 | learning rate: 6.666667E-04 | global batch size:     2 | lm loss: 7.056363E+00 | loss scale: \
1.0 | grad norm: 1.830 | number of skipped iterations:   0 | number of nan iterations:   0 |
[mm-e2e] iteration 2 lm loss: 0x1.c39c6a0000000p+2
 [2026-11-23 17:28:11.929273] iteration        3/       3 | consumed samples:            6 | elapsed time per \
iteration (ms): 39.5 | learning rate: 5.000000E-04 | global batch size:     2 | lm loss: 7.071983E+00 | loss scale: \
1.0 | grad norm: 2.204 | number of skipped iterations:   0 | number of nan iterations:   0 |
[mm-e2e] iteration 3 lm loss: 0x1.c4999c0000000p+2
[Rank 0] (after 3 iterations) memory (MB) | allocated: 100.00 | max allocated: 3072.00 | reserved: 0.00 | max \
reserved: 0.00
"""


def test_e2e_parses_megatron_log_and_judges_identity(monkeypatch):
    e2e = load_benchmark("megatron_lm_e2e", monkeypatch)
    run = e2e.parse_log(e2e.Run("import", "import, no flag"), MEGATRON_LOG)
    assert run.iteration_ms == {1: 953.0, 2: 50.5, 3: 39.5} and run.median_ms(warmup=1) == 45.0
    assert run.printed_loss == {1: 7.070902, 2: 7.056363, 3: 7.071983}
    assert run.losses() == {1: float.fromhex("0x1.c4890c0000000p+2"), 2: float.fromhex("0x1.c39c6a0000000p+2"),
                            3: float.fromhex("0x1.c4999c0000000p+2")}
    assert run.max_allocated_mb == 3072.0

    plain = e2e.parse_log(e2e.Run("unpatched", "unpatched"), MEGATRON_LOG)
    assert e2e.identity_verdict({"unpatched": plain, "import": run}) is None
    run.exact_loss[3] = float.fromhex("0x1.c4999c0000001p+2")  # one bit
    assert "iteration 3" in e2e.identity_verdict({"unpatched": plain, "import": run})
    assert e2e.max_relative_difference(run.losses(), plain.losses()) == pytest.approx(2 ** -50 / 7.07, rel=0.01)


def megatron_lm_checkout():
    path = os.environ.get("MM_ADAPTOR_MEGATRON_LM")
    if not path or not (Path(path) / "pretrain_gpt.py").is_file():
        pytest.skip("no Megatron-LM checkout: set MM_ADAPTOR_MEGATRON_LM to one (its pretrain_gpt.py) and "
                    "MM_ADAPTOR_MEGATRON_LM_PYTHON to an interpreter with its Python needs")
    return path


@pytest.mark.distributed
def test_e2e_runs_pretrain_gpt_on_the_cpu(tmp_path):
    checkout = megatron_lm_checkout()
    python = os.environ.get("MM_ADAPTOR_MEGATRON_LM_PYTHON", sys.executable)
    done = subprocess.run([python, str(BENCHMARKS / "megatron_lm_e2e.py"), "--megatron-lm", checkout,
                           "--device", "cpu", "--variants", "unpatched", "import", "fused-rmsnorm",
                           "--train-iters", "4", "--warmup-iters", "1", "--log-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    assert "[e2e]   --use-fused-rmsnorm: iteration 4/4" in done.stdout, done.stdout
    _, rows = table_rows(done.stdout)
    table = {row[0]: row[1:] for row in rows}
    assert list(table) == ["unpatched", "import, no flag", "--use-fused-rmsnorm"], done.stdout
    assert table["unpatched"][0].startswith("skipped: unpatched Megatron-LM requires CUDA"), done.stdout
    ms, speedup, memory, loss_diff = table["import, no flag"]
    assert float(ms) > 0 and speedup == "1.000x" and float(loss_diff) == 0, done.stdout
    ms, speedup, memory, loss_diff = table["--use-fused-rmsnorm"]
    assert float(ms) > 0 and float(speedup.rstrip("x")) > 0 and float(loss_diff) < 1e-5, done.stdout
    assert (tmp_path / "fused-rmsnorm.log").read_text().count("[mm-e2e] iteration") == 4


def e2e_losses(checkout, tmp_path, name, variants, nproc, *megatron_flags):
    python = os.environ.get("MM_ADAPTOR_MEGATRON_LM_PYTHON", sys.executable)
    logs = tmp_path / name
    done = subprocess.run([python, str(BENCHMARKS / "megatron_lm_e2e.py"), "--megatron-lm", checkout, "--device",
                           "cpu", "--variants", *variants, "--train-iters", "4", "--warmup-iters", "1",
                           "--seq-length", "128", "--nproc-per-node", str(nproc), "--log-dir", str(logs), "--",
                           *megatron_flags], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    return {variant: (logs / f"{variant}.log").read_text() for variant in variants}


def probed_losses(log):
    return [float.fromhex(x) for x in re.findall(r"\[mm-e2e\] iteration \d+ lm loss: (\S+)", log)]


@pytest.mark.distributed
def test_e2e_document_masks_and_context_parallelism_in_pretrain_gpt(tmp_path):
    """Megatron-LM's --reset-attention-mask at TP2+SP: --use-flash-attn's varlen op on the documents (its calls
    counted) gives the no-flag run's losses; --context-parallel-size 2 (ring, then Ulysses) gives the one-rank
    CP1 run's losses within float32 rounding."""
    checkout = megatron_lm_checkout()
    documents = e2e_losses(checkout, tmp_path, "documents", ["import", "flash-attn"], 2,
                           "--tensor-model-parallel-size", "2", "--sequence-parallel", "--reset-attention-mask",
                           "--reset-position-ids")
    plain, varlen = probed_losses(documents["import"]), probed_losses(documents["flash-attn"])
    assert len(plain) == 4 and max(abs(a - b) / abs(b) for a, b in zip(varlen, plain)) < 1e-6, (varlen, plain)
    calls = [int(n) for n in re.findall(r"document attention calls: (\d+)", documents["flash-attn"])]
    assert calls and calls[-1] > 0 and "document attention calls" not in documents["import"], calls
    whole = probed_losses(e2e_losses(checkout, tmp_path, "cp1", ["import"], 1)["import"])
    for algo in ("megatron_cp_algo", "ulysses_cp_algo"):
        split = probed_losses(e2e_losses(checkout, tmp_path, algo, ["import"], 2, "--context-parallel-size", "2",
                                         "--context-parallel-algo", algo)["import"])
        assert len(split) == 4 and max(abs(a - b) / abs(b) for a, b in zip(split, whole)) < 1e-6, (algo, split)


def test_activation_memory_benchmark_moves_and_drops_bytes():
    stdout = run_script("activation_memory.py", "--device", "cpu", "--hidden", "128", "--ffn", "344", "--heads", "2",
                        "--seq", "256", "--steps", "1", "--warmup", "1")
    header, rows = table_rows(stdout)
    assert "step ms" in header and "saved in host MiB" in header, stdout
    by_name = {row[0]: row for row in rows}
    assert list(by_name) == ["unpatched", "recompute activation", "swap attention", "both"], stdout
    device, host = (lambda name: float(by_name[name][3])), (lambda name: float(by_name[name][4]))
    assert device("recompute activation") < device("unpatched") and host("recompute activation") == 0, stdout
    assert host("swap attention") > 0 and device("swap attention") < device("unpatched"), stdout
    assert device("both") < device("swap attention"), stdout


def test_activation_memory_benchmark_on_moe_layers():
    stdout = run_script("activation_memory.py", "--device", "cpu", "--experts", "4", "--topk", "2", "--hidden", "64",
                        "--ffn", "128", "--heads", "2", "--seq", "64", "--steps", "1", "--warmup", "1",
                        "--configs", "unpatched,moe-zero-memory level0,moe-zero-memory level1")
    header, rows = table_rows(stdout)
    assert "4 experts of ffn 128, top-2" in stdout, stdout
    device = {row[0]: float(row[3]) for row in rows}
    assert list(device) == ["unpatched", "moe-zero-memory level0", "moe-zero-memory level1"], stdout
    assert device["moe-zero-memory level1"] < device["moe-zero-memory level0"] < device["unpatched"], stdout


def test_optimizer_memory_benchmark_moves_optimizer_state():
    stdout = run_script("optimizer_memory.py", "--device", "cpu", "--layers", "1", "--hidden", "128", "--ffn", "344",
                        "--heads", "2", "--vocab", "512", "--seq", "32", "--steps", "1", "--warmup", "1",
                        "--configs", "unpatched,swap-optimizer", "--start", "fork")  # each a fresh (forked) process
    header, rows = table_rows(stdout)
    assert "optimizer step ms" in header and "in host memory GiB" in header, stdout
    by_name = {row[0]: row for row in rows}
    assert list(by_name) == ["unpatched", "swap-optimizer"], stdout
    assert "GB copied per step" in stdout and "GB/s over the optimizer step" in stdout, stdout


def test_coc_overlap_benchmark_prints_measured_and_predicted_times():
    stdout = run_script("coc_overlap.py", "--hidden", "32", "--ffn", "48", "--seq", "64", "--micro-batch", "1",
                        "--iters", "1", "--warmup", "0", "--start", "fork")
    header, rows = table_rows(stdout)
    assert [row[0] for row in rows] == ["megatron (unpatched)"] + [f"--use-coc --coc-parallel-num {n}"
                                                                   for n in (2, 4, 8)], stdout
    for row in rows:
        assert float(row[1]) > 0 and float(row[3]) > 0, stdout
    assert re.search(r"GEMM [\d.]+ GFLOP/s, all-gather bus bandwidth [\d.]+ GB/s", stdout), stdout


def test_coc_cost_model(monkeypatch):
    cost = load_benchmark("coc_cost_model", monkeypatch)
    layer = cost.Layer(hidden=1024, ffn=4096, seq=2048, micro_batch=1, tp=8)
    free_link = cost.Machine("no communication cost", 1e12, float("inf"), 0.0)
    assert cost.predict(layer, free_link)["saved"] == pytest.approx(0)  # nothing to hide
    balanced = cost.Machine("balanced", 1e12, 1e11, 0.0)
    p = cost.predict(layer, balanced)
    assert p["coc"][1] == p["megatron"] and p["saved"] > 0 and p["best"] == 8  # no latency: more chunks win
    costly_calls = cost.Machine("latency-bound", 1e12, 1e11, 1e-3)
    assert cost.predict(layer, costly_calls)["best"] == 1  # each extra collective costs more than it hides
    assert cost.pipeline(1.0, 1.0, 4) == pytest.approx(1.25)
    stdout = run_script("coc_cost_model.py")
    assert "NVLink-class" in stdout and "PCIe-class" in stdout and "TP8" in stdout


def test_vpp_extra_warmup_benchmark_prints_both_schedules():
    stdout = run_script("vpp_extra_warmup.py", "--hidden", "64", "--seq", "64", "--micro-batches", "4", "--iters", "2",
                        "--layouts", "PP2+VPP2", "--start", "fork")
    header, rows = table_rows(stdout)
    assert [row[0] for row in rows] == ["PP2+VPP2"], stdout
    assert float(rows[0][1]) > 0 and float(rows[0][2]) > 0 and rows[0][3].endswith("x"), stdout
    predicted_plain, predicted_extra = (float(v) for v in rows[0][4].split(" / "))
    assert predicted_plain > 0 and predicted_extra > 0, stdout
    # 4 micro-batches x 2 chunks: megatron's first stage warms up with 4, holds 5; with one extra 6 (observed too)
    assert rows[0][5] == "5 and 6 / 6", stdout
    assert "measured with: host clock" in stdout, "the CPU backend's chunk times are host-side and must say so"


def test_vision_encoder_memory_benchmark_measures_both_paths(monkeypatch):
    """In process at a small image: the dense-mask tower saves more than the varlen one, and the ratio is theirs."""
    from gloo_rank import one_gloo_rank
    from megatron.core import tensor_parallel

    bench = load_benchmark("vision_encoder_memory", monkeypatch)
    with one_gloo_rank():
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        dense, varlen = bench.measure("qwen2_5_vl", "tiny", 112, 2)
    assert (dense["attention"], varlen["attention"]) == ("dense", "varlen") and dense["patches"] == 64
    assert dense["bytes"] > varlen["bytes"] > 0
    assert dense["dense / varlen"] == pytest.approx(dense["bytes"] / varlen["bytes"])



def test_moe_balance_compares_balanced_with_unbalanced_experts():
    """EP2, one step, a strong skew: both runs train to the same loss; balanced, the busiest rank computes fewer
    expert rows and sends fewer all-to-all bytes, and receives the hot experts' parameters."""
    stdout = run_script("moe_balance.py", "--ep", "2", "--steps", "1", "--seq", "64", "--layers", "1",
                        "--experts", "4", "--hot", "1", "--skew", "3")
    header, rows = table_rows(stdout)
    assert [row[1] for row in rows] == ["unbalanced", "--balanced-moe-experts N 1"], stdout
    off, on = rows
    assert float(on[2]) < float(off[2]) and float(on[3]) < float(off[3]), stdout
    assert int(on[5].replace(",", "")) < int(off[5].replace(",", "")), stdout
    assert off[7] == "0" and int(on[7].replace(",", "")) > 0 and on[8] == off[8], stdout
