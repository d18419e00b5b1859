"""Simulate: the catalog of device kinds a cluster file may name, with the figures the step model needs.

Peak rates are the vendors' dense figures (no structured sparsity) for the precision a rank trains in under
``device_precision="auto"`` (:func:`~lightning_hetero.precision.choice.best_precision`): fp32 is the plain FP32 rate,
not TF32, because PyTorch leaves TF32 matmuls off by default. Memory is what the device reports (GiB); memory
bandwidth in GB/s (10^9 bytes). A cluster file can replace any figure of any device inline.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, replace
from typing import Any, Optional, TypedDict

from lightning_hetero.measure.facts import DeviceFacts
from lightning_hetero.precision.choice import BF16, FP16, FP32, best_precision

GIB = 1024**3
TERA = 1e12
GIGA = 1e9


@dataclass(frozen=True)
class DeviceKind:
    """One kind of device: what the step model needs to predict its compute time and memory ceiling."""

    name: str
    type: str  # "cuda" or "cpu"
    memory_bytes: float
    memory_bandwidth: float  # bytes per second
    peak_flops: dict[str, float] = field(default_factory=dict)  # precision ("32-true", ...) -> FLOP/s
    bf16_native: bool = False
    supports_fp16: bool = True
    # The fraction of peak a training step reaches; None: the step model's default for the type, unless a
    # measurement calibrates it (this machine's CPU, a run report of the kind).
    efficiency: Optional[float] = None
    speed: float = 1.0  # an extra factor on the rate (emulated slowdowns, throttled parts)
    source: str = ""
    cpu: Optional[tuple[int, str, float]] = None  # a CPU's cores, ISA and GHz
    # The fraction of the memory bandwidth a training step's memory-bound kernels reach (the roofline's slope);
    # None: DEFAULT_BANDWIDTH_EFFICIENCY. Fitted to published training speeds (BANDWIDTH_EFFICIENCY_SOURCE).
    bandwidth_efficiency: Optional[float] = None

    def facts(self) -> DeviceFacts:
        """The facts :func:`best_precision` reads, so the simulator chooses precisions exactly as a run would."""
        return DeviceFacts(
            kind=self.type,
            name=self.name,
            hostname="simulated",
            supports_bf16=BF16 in self.peak_flops,
            bf16_native=self.bf16_native,
            supports_fp16=self.supports_fp16,
        )

    def precision(self) -> str:
        return best_precision(self.facts())

    def peak(self, precision: str) -> float:
        return self.peak_flops.get(precision) or self.peak_flops[FP32]


def _gpu(name, memory_gib, bandwidth_gbs, fp32, fp16, bf16, source, bandwidth_efficiency=None) -> DeviceKind:
    peaks = {FP32: fp32 * TERA, FP16: fp16 * TERA}
    if bf16 is not None:
        peaks[BF16] = bf16 * TERA
    return DeviceKind(
        name=name,
        type="cuda",
        memory_bytes=memory_gib * GIB,
        memory_bandwidth=bandwidth_gbs * GIGA,
        peak_flops=peaks,
        bf16_native=bf16 is not None,
        source=source,
        bandwidth_efficiency=bandwidth_efficiency,
    )


# The roofline's achievable fractions (lightning_hetero.simulate.device_model): matrix products at
# MATMUL_EFFICIENCY of the tensor-core peak on every kind, memory-bound kernels at each kind's bandwidth efficiency
# below. Both fitted by `python benchmarks/planner_validation.py --fit` to the calibration rows: Lambda's
# deeplearning-benchmark, PyTorch training throughput, mixed precision, one GPU, ResNet-50 and BERT-base SQuAD
# (https://github.com/lambdal/deeplearning-benchmark/blob/aa5addb6a53675a649a80036dad548f1c27cbcc4/pytorch/
# pytorch-train-throughput-fp16.csv). BERT-large (Lambda) and NVIDIA's DeepLearningExamples were kept out of the
# fit; the benchmark prints the held-out rows apart. A kind without a published figure takes the median.
BANDWIDTH_EFFICIENCY_SOURCE = (
    "fitted to Lambda deeplearning-benchmark @aa5addb (pytorch-train-throughput-fp16.csv: ResNet-50, BERT-base SQuAD)"
)
MATMUL_EFFICIENCY = 1.0
BANDWIDTH_EFFICIENCY = {
    "V100-16GB": 0.41,
    "RTX-3090": 0.47,
    "A10": 0.43,
    "A100-40GB": 0.41,
    "A100-80GB-PCIe": 0.36,
    "A100-80GB": 0.37,
    "RTX-4090": 0.59,
    "H100-PCIe": 0.45,
    "H100": 0.38,
    "H200": 0.31,
}
DEFAULT_BANDWIDTH_EFFICIENCY = 0.41  # the median of the fitted kinds


# name, memory (GiB), memory bandwidth (GB/s), fp32 / fp16 / bf16 dense TFLOPS (tensor cores with fp32 accumulate for
# the 16-bit figures), source.
GPU_KINDS = {
    kind.name: kind
    for kind in (
        _gpu("A100-40GB", 40, 1555, 19.5, 312, 312, "NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB)"),
        _gpu("A100-80GB", 80, 2039, 19.5, 312, 312, "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB)"),
        _gpu("A100-80GB-PCIe", 80, 1935, 19.5, 312, 312, "NVIDIA A100 Tensor Core GPU datasheet (PCIe 80GB)"),
        _gpu("H100-PCIe", 80, 2000, 51.2, 756, 756, "NVIDIA H100 Tensor Core GPU datasheet (PCIe, dense)"),
        _gpu("H100", 80, 3350, 67, 989.4, 989.4, "NVIDIA H100 Tensor Core GPU datasheet (SXM5, dense)"),
        _gpu("H200", 141, 4800, 67, 989.4, 989.4, "NVIDIA H200 Tensor Core GPU datasheet (SXM, dense)"),
        _gpu("V100-16GB", 16, 900, 15.7, 125, None, "NVIDIA V100 Tensor Core GPU datasheet (SXM2)"),
        _gpu("V100-32GB", 32, 900, 15.7, 125, None, "NVIDIA V100 Tensor Core GPU datasheet (SXM2)"),
        _gpu("T4", 16, 320, 8.1, 65, None, "NVIDIA T4 Tensor Core GPU datasheet"),
        _gpu("L4", 24, 300, 30.3, 121, 121, "NVIDIA L4 Tensor Core GPU datasheet (dense: half the sparsity figure)"),
        _gpu("A10", 24, 600, 31.2, 125, 125, "NVIDIA A10 Tensor Core GPU datasheet (dense)"),
        _gpu("RTX-3090", 24, 936, 35.6, 71, 71, "NVIDIA Ampere GA102 GPU architecture whitepaper, appendix A"),
        _gpu("RTX-4090", 24, 1008, 82.6, 165.2, 165.2, "NVIDIA Ada GPU architecture whitepaper, appendix A"),
    )
}
# (the fitted fractions, with the kinds that share a part: a V100-32GB is a V100-16GB with more memory)
for _name, _kind in list(GPU_KINDS.items()):
    _fitted = BANDWIDTH_EFFICIENCY.get(_name, BANDWIDTH_EFFICIENCY.get(_name.replace("32GB", "16GB")))
    if _fitted is not None:
        GPU_KINDS[_name] = replace(
            _kind, bandwidth_efficiency=_fitted, source=f"{_kind.source}; {BANDWIDTH_EFFICIENCY_SOURCE}"
        )

# FP32 FLOPs per cycle per core for each instruction set (two FMA units of the vector width), and the 16-bit rate
# where the hardware computes it natively. Sources: Intel 64 and IA-32 Architectures Optimization Reference Manual
# (FMA throughput per port), Intel AMX overview (1,024 BF16 FLOPs per cycle per core on Sapphire Rapids).
CPU_ISAS: dict[str, tuple[float, Optional[float]]] = {
    "avx2": (32.0, None),
    "avx512": (64.0, None),
    "avx512_bf16": (64.0, 128.0),
    "amx": (64.0, 1024.0),
}


class _CpuDefaults(TypedDict):
    isa: str
    ghz: float
    memory: float
    memory_bandwidth: float


# What a cluster file's cpu entry gets when it does not say (cpu_kind's defaults too).
CPU_DEFAULTS: _CpuDefaults = {"isa": "avx512", "ghz": 2.5, "memory": 64 * GIB, "memory_bandwidth": 100 * GIGA}


def cpu_kind(
    cores: int,
    isa: str = CPU_DEFAULTS["isa"],
    ghz: float = CPU_DEFAULTS["ghz"],
    memory_bytes: float = CPU_DEFAULTS["memory"],
    memory_bandwidth: float = CPU_DEFAULTS["memory_bandwidth"],
) -> DeviceKind:
    """A CPU of ``cores`` cores running torch's kernels for ``isa`` at ``ghz``."""
    fp32_per_cycle, bf16_per_cycle = CPU_ISAS[isa]
    peaks = {FP32: cores * ghz * 1e9 * fp32_per_cycle}
    if bf16_per_cycle is not None:
        peaks[BF16] = cores * ghz * 1e9 * bf16_per_cycle
    return DeviceKind(
        name=f"cpu-{cores}c-{isa}",
        type="cpu",
        memory_bytes=memory_bytes,
        memory_bandwidth=memory_bandwidth,
        peak_flops=peaks,
        bf16_native=bf16_per_cycle is not None,
        supports_fp16=False,  # CPUs have no fast fp16 kernels: "auto" never picks fp16 for them
        source=f"{cores} cores x {ghz} GHz x {fp32_per_cycle:g} FP32 FLOPs/cycle ({isa})",
        cpu=(cores, isa, ghz),
    )


def known_kinds() -> list[str]:
    return sorted(GPU_KINDS) + ["cpu"]


def closest_kinds(name: str) -> str:
    """The catalog's names that ``name`` starts (``A100``: both A100 kinds), else the closest one, quoted."""
    wanted = folded_name(name)
    starting = [n for n in known_kinds() if wanted and folded_name(n).startswith(wanted)]
    return ", ".join(repr(n) for n in starting) if starting else repr(closest_kind(name))


def closest_kind(name: str) -> str:
    """The catalog's name closest to ``name`` (for an error message)."""
    names = known_kinds()
    folded = {n.lower(): n for n in names}
    matches = difflib.get_close_matches(str(name).lower(), list(folded), n=1, cutoff=0.0)
    return folded[matches[0]]


def lookup(name: Any) -> DeviceKind:
    """The catalog's GPU kind ``name`` (case and ``_``/``-``/space insensitive); a ``KeyError`` naming the closest."""
    wanted = folded_name(name)
    for kind_name, kind in GPU_KINDS.items():
        if folded_name(kind_name) == wanted:
            return kind
    raise KeyError(
        f"unknown device kind {name!r}; the closest known kinds: {closest_kinds(name)} (known: "
        f"{', '.join(known_kinds())}; or give the figures inline: memory, memory_bandwidth, tflops)"
    )


def folded_name(name: Any) -> str:
    """``name`` compared loosely: lower case, letters and digits only ("A100-80GB" == "a100 80gb")."""
    return "".join(ch for ch in str(name).lower() if ch.isalnum())


def kind_of_device_name(device_name: str) -> Optional[DeviceKind]:
    """The catalog kind a device's reported name is (``"NVIDIA A100-SXM4-80GB"`` is A100-80GB), or None."""
    folded = folded_name(device_name)
    matches = [kind for kind in GPU_KINDS.values() if all(folded_name(part) in folded for part in kind.name.split("-"))]
    # "A100" alone would match both A100s: the kind with the most specific name (memory included) wins.
    return max(matches, key=lambda kind: len(kind.name), default=None)


def with_overrides(kind: DeviceKind, **changes: Any) -> DeviceKind:
    """``kind`` with some figures replaced (an inline override in the cluster file)."""
    changes = {key: value for key, value in changes.items() if value is not None}
    if "peak_flops" in changes:
        changes["peak_flops"] = {**kind.peak_flops, **changes["peak_flops"]}
    return replace(kind, **changes)
