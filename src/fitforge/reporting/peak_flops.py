"""The dense peak FLOP rates of common accelerators (the vendors' datasheets), for model FLOPs utilisation."""

from __future__ import annotations

import torch

_T = 1e12
# name fragment (as torch.cuda.get_device_name shows it) -> {precision: dense FLOP/s}; the first match wins,
# so a specific name (H100 PCIe) comes before the family's (H100, the SXM part).
_PEAKS: list[tuple[str, dict[str, float]]] = [
    ("H200 NVL", {"bf16": 835 * _T, "fp16": 835 * _T, "tf32": 418 * _T, "fp32": 60 * _T}),
    ("H200", {"bf16": 989 * _T, "fp16": 989 * _T, "tf32": 494 * _T, "fp32": 67 * _T}),
    ("H100 NVL", {"bf16": 835 * _T, "fp16": 835 * _T, "tf32": 418 * _T, "fp32": 60 * _T}),
    ("H100 PCIe", {"bf16": 756 * _T, "fp16": 756 * _T, "tf32": 378 * _T, "fp32": 51 * _T}),
    ("H100", {"bf16": 989 * _T, "fp16": 989 * _T, "tf32": 494 * _T, "fp32": 67 * _T}),
    ("A100", {"bf16": 312 * _T, "fp16": 312 * _T, "tf32": 156 * _T, "fp32": 19.5 * _T}),
    ("L40S", {"bf16": 362 * _T, "fp16": 362 * _T, "tf32": 183 * _T, "fp32": 91.6 * _T}),
    ("L40", {"bf16": 181 * _T, "fp16": 181 * _T, "tf32": 90.5 * _T, "fp32": 90.5 * _T}),
    ("A10G", {"bf16": 70 * _T, "fp16": 70 * _T, "tf32": 35 * _T, "fp32": 31.2 * _T}),
    ("L4", {"bf16": 121 * _T, "fp16": 121 * _T, "tf32": 60 * _T, "fp32": 30.3 * _T}),
    ("V100", {"fp16": 125 * _T, "fp32": 15.7 * _T}),
    ("T4", {"fp16": 65 * _T, "fp32": 8.1 * _T}),
]


def precision_of(dtype: torch.dtype | None) -> str:
    """The table's precision for the dtype of the maths (None: float32, as TF32 where torch allows it)."""
    if dtype is torch.bfloat16:
        return "bf16"
    if dtype is torch.float16:
        return "fp16"
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def peak_flops(device: torch.device, dtype: torch.dtype | None) -> float | None:
    """The device's dense peak in FLOP/s for ``dtype``'s maths, or None where it is not known."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, peaks in _PEAKS:
        if fragment in name:
            return peaks.get(precision_of(dtype))
    return None
