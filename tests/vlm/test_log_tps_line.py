"""--log-tps: the iteration line and the summary carry MindSpeed-MM's tokens per sample, tokens per second of
non-padding language tokens and samples per second; without it the GPT line is unchanged."""

from mm_adaptor.harness.runner import logs, parse_args
from mm_adaptor.harness.runner.logs import StepRecord, format_iteration, summary

RECORD = StepRecord(iteration=3, loss=2.5, grad_norm=1.25, elapsed_ms=250.0, lr=1e-3, tokens_per_second=2344.0,
                    tokens_per_sample=146.5, samples_per_second=16.0)


def _args(*extra):
    args = parse_args(["--model", "qwen2_5_vl-tiny", "--train-iters", "20", "--global-batch-size", "4", *extra])
    return args


def test_iteration_line_with_log_tps(monkeypatch):
    monkeypatch.setattr(logs.time, "strftime", lambda fmt: "2026-11-25 07:30:00")
    line = format_iteration(_args("--log-tps"), RECORD, consumed=12, loss_scale=1.0)
    assert line == (" [2026-11-25 07:30:00] iteration        3/      20 | consumed samples:           12 | "
                    "elapsed time per iteration (ms): 250.0 | learning rate: 1.000000E-03 | global batch size:     4 | "
                    "lm loss: 2.500000E+00 | loss scale: 1.0 | grad norm: 1.250 | tokens per sample: 146.5 | "
                    "tokens per second: 2344.0 | samples per second: 16.00 |")


def test_iteration_line_without_log_tps_is_the_gpt_line(monkeypatch):
    monkeypatch.setattr(logs.time, "strftime", lambda fmt: "2026-11-25 07:30:00")
    line = format_iteration(_args(), RECORD, consumed=12, loss_scale=1.0)
    assert line.endswith("| grad norm: 1.250 | tokens per second: 2344.0 |")
    assert "per sample" not in line


def test_summary_with_log_tps():
    first = StepRecord(1, 6.0, 1.0, 900.0, 1e-3, 100.0, 140.0, 4.0)
    line = summary(_args("--log-tps"), [first, RECORD], 0, "TP2+PP1+DP1+fp32")
    assert line.endswith("| tokens per second 2344.0 (non-padding) | tokens per sample 146.5 | "
                         "samples per second 16.00")
