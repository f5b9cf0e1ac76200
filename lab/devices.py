"""Device profiles (the targets a sweep can ask for) and detection of the GPU present.

Every figure carries its source. "measured here" = measured on this project's H100 test machine,
2026-11 (see ../shared/briefs/hardware.md); "datasheet" = vendor figure.
Units: bytes for memory sizes, GB/s for bandwidth, TFLOP/s for tensor rates.
"""
from __future__ import annotations

from dataclasses import dataclass, field


class LabError(Exception):
    """A user-facing error: printed as one line by the CLI, exit status 2."""


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    gpu: str                      # marketing name
    match: tuple[str, ...]        # substrings of torch.cuda.get_device_name() that identify it
    target: str                   # compile target, e.g. "sm_90a"
    capability: tuple[int, int]
    sms: int
    smem_optin_bytes: int         # max dynamic shared memory per block (opt-in), after the 1 KiB reservation
    smem_per_sm_bytes: int | None
    l2_bytes: int | None
    mem_bw_gbs: float | None      # the denominator for "% of peak" bandwidth
    bf16_tflops: float | None     # dense BF16 tensor-core denominator for "% of peak"
    sources: dict = field(default_factory=dict)

    @property
    def smem_optin_kib(self) -> float:
        return self.smem_optin_bytes / 1024


KIB, MIB = 1024, 1024 * 1024

PROFILES: dict[str, DeviceProfile] = {p.name: p for p in [
    DeviceProfile(
        "h100", "H100 SXM 80GB", ("H100",), "sm_90a", (9, 0), 132, 232_448, 233_472, 50 * MIB,
        3000.0, 774.0,
        {"sms": "measured here", "smem": "measured here (227 KiB opt-in)", "l2": "measured here",
         "mem_bw_gbs": "~3.0 TB/s device copy measured here (datasheet 3.35 TB/s)",
         "bf16_tflops": "cuBLAS 774 TFLOP/s at 4096^3 measured here (datasheet ~989 dense)"}),
    DeviceProfile(
        "h200", "H200 141GB", ("H200",), "sm_90a", (9, 0), 132, 232_448, 233_472, 60 * MIB,
        4300.0, 774.0,
        {"sms": "datasheet", "smem": "same SM as H100", "l2": "measured on this workplace (60 MB)",
         "mem_bw_gbs": "~4.3 TB/s device copy measured on this workplace (datasheet 4.8 TB/s)",
         "bf16_tflops": "same tensor cores as H100: cuBLAS 774 TFLOP/s measured on H100"}),
    DeviceProfile(
        "b200", "B200", ("B200",), "sm_100a", (10, 0), 148, 232_448, None, None, 8000.0, 2250.0,
        {"sms": "datasheet", "smem": "datasheet (227 KiB opt-in)", "mem_bw_gbs": "~8 TB/s HBM3e datasheet",
         "bf16_tflops": "~2,250 TFLOP/s dense datasheet"}),
    DeviceProfile(
        "gb10", "GB10 (DGX Spark)", ("GB10",), "sm_121a", (12, 1), 48, 101_376, None, None, 273.0, 62.0,
        {"sms": "datasheet", "smem": "101,376 B = 99 KiB opt-in (consumer Blackwell)",
         "mem_bw_gbs": "~273 GB/s LPDDR5X datasheet",
         "bf16_tflops": "~62 TFLOP/s practical BF16 (table figure ~100)"}),
    DeviceProfile(
        "rtx5090", "RTX 5090", ("RTX 5090",), "sm_120a", (12, 0), 170, 101_376, None, None, None, None,
        {"sms": "datasheet", "smem": "101,376 B = 99 KiB opt-in (consumer Blackwell)"}),
]}


def get_profile(name: str) -> DeviceProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise LabError(f"unknown device {name!r} (known: {', '.join(PROFILES)})") from None


@dataclass(frozen=True)
class PresentGPU:
    """The GPU this process can see, as the driver reports it."""
    name: str                     # torch.cuda.get_device_name()
    capability: tuple[int, int]
    sms: int
    l2_bytes: int
    profile: str | None           # matching profile name, or None if the GPU has no profile


def match_profile(gpu_name: str) -> str | None:
    for p in PROFILES.values():
        if any(m.lower() in gpu_name.lower() for m in p.match):
            return p.name
    return None


def detect() -> PresentGPU | None:
    """The first visible CUDA GPU, or None when there is none (CPU-only machine)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return PresentGPU(props.name, (props.major, props.minor), props.multi_processor_count,
                      int(getattr(props, "L2_cache_size", 0)), match_profile(props.name))


def present_label(gpu: PresentGPU | None) -> str:
    return "none (CPU only)" if gpu is None else gpu.name
