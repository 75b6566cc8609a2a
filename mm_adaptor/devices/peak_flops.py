"""Peak dense matrix throughput per device, for the trainer's MFU: the vendor's published dense (not 2:4 sparse)
figure for the run's precision (bf16/fp16 tensor cores; fp32 runs: TF32 tensor cores, which torch uses for fp32
matrix products only when allowed, so an fp32 MFU is a lower bound). --mfu-peak-tflops overrides the table."""

from __future__ import annotations

from dataclasses import dataclass

# (name substring as torch reports it, label, 16-bit dense TFLOP/s, TF32 dense TFLOP/s); the first match wins
TABLE = (
    ("H200", "NVIDIA H200 (SXM)", 989.4, 494.7),
    ("GH200", "NVIDIA GH200", 989.4, 494.7),
    ("H100 PCIe", "NVIDIA H100 PCIe", 756.0, 378.0),
    ("H100 NVL", "NVIDIA H100 NVL", 835.0, 417.5),
    ("H100", "NVIDIA H100 (SXM)", 989.4, 494.7),
    ("H800", "NVIDIA H800 (SXM)", 989.4, 494.7),
    ("H20", "NVIDIA H20", 148.0, 74.0),
    ("B200", "NVIDIA B200", 2250.0, 1100.0),
    ("A100", "NVIDIA A100", 312.0, 156.0),
    ("A800", "NVIDIA A800", 312.0, 156.0),
    ("L40S", "NVIDIA L40S", 362.0, 183.0),
    ("Ascend910B1", "Ascend 910B1", 414.0, None),
    ("Ascend910B2", "Ascend 910B2", 376.0, None),
    ("Ascend910B3", "Ascend 910B3", 313.0, None),
    ("Ascend910B4", "Ascend 910B4", 280.0, None),
)


@dataclass(frozen=True)
class Peak:
    label: str
    precision: str
    tflops: float

    def describe(self) -> str:
        return f"{self.tflops:g} TFLOP/s ({self.label}, {self.precision} dense peak)"


def device_name() -> str | None:
    from mm_adaptor import devices

    backend = devices.current()
    if backend is None or backend.name == "cpu":
        return None
    module = backend.stream_module()
    try:
        return module.get_device_name()
    except Exception:  # noqa: BLE001 - a device without a name has no peak here
        return None


def lookup(name: str, precision: str) -> Peak | None:
    for key, label, sixteen, tf32 in TABLE:
        if key.replace(" ", "").lower() in name.replace(" ", "").lower():
            value = tf32 if precision == "fp32" else sixteen
            return None if value is None else Peak(label, "TF32" if precision == "fp32" else precision, value)
    return None


def peak_for_run(args) -> Peak | None:
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    override = getattr(args, "mfu_peak_tflops", None)
    if override:
        return Peak("--mfu-peak-tflops", precision, float(override))
    name = device_name()
    return lookup(name, precision) if name else None


def no_peak_reason() -> str:
    name = device_name()
    if name is None:
        return "no peak for the CPU; give --mfu-peak-tflops"
    return f"no peak known for {name}; give --mfu-peak-tflops"
