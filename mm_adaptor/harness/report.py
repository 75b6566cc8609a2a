"""A comparison as text: what was judged, by which limits, the worst of each statistic and the memory figures."""

from __future__ import annotations

from mm_adaptor.harness.verdict import loss_statistic


def _mib(n: int) -> str:
    return f"{n / 2**20:9.3f} MiB"


def _layer_order(label: str):
    """'layer N' (the language model's), then 'vision layer N', each by N, then the rest."""
    *tower, word, number = label.split() if len(label.split()) >= 2 else ("", "", "")
    if word == "layer" and number.isdigit() and tower in ([], ["vision"]):
        return (len(tower), int(number), "")
    return (2, 0, label)


GROUP_LABELS = {"loss": "losses", "activations": "module outputs (step 1, first micro-batch)",
                "gradients": "gradients (every step)", "parameters": "parameters (change from start)"}


def _group_lines(group, exact: bool) -> list[str]:
    w = group.worst
    if not group.count:
        return []
    if exact:
        worst = f"largest difference {w.stat} {w.value:.2e} ({w.where})" if w.value else "all equal"
    else:
        worst = f"worst {w.ratio:.2f} of its limit: {w.stat} {w.value:.2e} <= {w.limit:.1e} ({w.where})" \
            if w.where else "no difference"
    lines = [f"  {GROUP_LABELS[group.group]}: {group.count} compared; {worst}"]
    for failure in group.failures[:5]:
        lines.append(f"    outside tolerance: {failure}")
    if len(group.failures) > 5:
        lines.append(f"    ... and {len(group.failures) - 5} more")
    return lines


MODEL_STATE_ROWS = (("parameters", "parameter_bytes"), ("gradients (main_grad)", "gradient_bytes"),
                    ("optimizer main params", "optimizer_main_param_bytes"),
                    ("optimizer moments", "optimizer_moment_bytes"))


def _model_state_rows(off: dict, on: dict) -> list[tuple[str, int, int]]:
    """One row per kind of model state (mm_adaptor.devices.memory.model_state_bytes), split into device and host rows
    where either run parks some in host memory; then the totals per residence."""
    rows = []
    for label, key in MODEL_STATE_ROWS:
        host_off, host_on = (m["by_residence"]["host"][key] for m in (off, on))
        if host_off or host_on:
            rows.append((f"{label}, on device", off[key] - host_off, on[key] - host_on))
            rows.append((f"{label}, in host memory", host_off, host_on))
        else:
            rows.append((label, off[key], on[key]))
    rows.append(("model state on device", off["device_bytes"], on["device_bytes"]))
    if off["host_bytes"] or on["host_bytes"]:
        rows.append(("model state in host memory", off["host_bytes"], on["host_bytes"]))
    return rows


def _saved_activation_rows(off: dict, on: dict) -> list[tuple[str, int, int]]:
    """Saved activations per layer on the device; where either run parks some in host memory, those per layer
    too, in their own rows."""
    rows = []
    for key, where in (("saved_bytes_per_layer", ""), ("host_saved_bytes_per_layer", " in host memory")):
        layers_off, layers_on = off.get(key) or {}, on.get(key) or {}
        rows += [(f"saved activations{where}, {k}", layers_off.get(k, 0), layers_on.get(k, 0))
                 for k in sorted(set(layers_off) | set(layers_on), key=_layer_order)]
    return rows


def format_comparison(c) -> str:
    lines = [f"check {' '.join(c.feature_args)} | layout {c.layout} | {c.precision} | "
             f"tolerance: {c.tolerance.describe()}",
             f"  limits: {c.limits.describe()}",
             *([f"  noise draws: {', '.join(c.noise_draws)}"] if c.noise_draws else []),
             *([f"  device calibration: {c.calibration}"] if c.calibration else []),
             f"  {'step':>4}  {'loss (off)':>16}  {'loss (on)':>16}  {'rel diff':>10}"]
    failing_steps = {f.split()[1] for f in c.loss_failures if f.startswith("step ")}
    for step, (a, b) in enumerate(zip(c.losses_off, c.losses_on), start=1):
        mark = "  <- outside tolerance" if str(step) in failing_steps else ""
        lines.append(f"  {step:>4}  {a:16.9e}  {b:16.9e}  {loss_statistic(a, b):10.2e}{mark}")
    for group in c.verdicts.values():
        lines += _group_lines(group, c.limits.exact)
    lines.append(f"  {'memory (rank 0)':<42} {'off':>13}  {'on':>13}  change")
    rows = _saved_activation_rows(c.memory_off, c.memory_on)
    rows += _model_state_rows(c.memory_off, c.memory_on)
    for label, a, b in rows:
        change = f"{(b - a) / a * 100:+.1f}%" if a else "n/a"
        lines.append(f"  {label:<42} {_mib(a)}  {_mib(b)}  {change}")
    lines.append(f"  verdict: {'PASS' if c.passed else 'FAIL'}")
    return "\n".join(lines)
