"""Measure: static facts about the device this rank trains on.

The facts feed the split plan and its printed table, and travel between ranks as JSON, so they are a plain frozen
dataclass. Collecting them never raises because NVML, the driver or ``/proc`` is missing: what cannot be read is
left ``None`` and explained in ``notes``, and ``sources`` says what the rest came from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional, TypeVar, Union

_T = TypeVar("_T")

# CPU features that decide which kernels oneDNN / torch can use; the rest of /proc/cpuinfo's flags are noise here.
ML_ISA_FEATURES = frozenset(
    {
        # x86
        "sse4_2",
        "avx",
        "avx2",
        "fma",
        "f16c",
        "avx_vnni",
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512dq",
        "avx512_vnni",
        "avx512_bf16",
        "avx512_fp16",
        "amx_tile",
        "amx_bf16",
        "amx_int8",
        "amx_fp16",
        # arm64 ("Features" line)
        "asimd",
        "asimdhp",
        "sve",
        "sve2",
        "bf16",
        "svebf16",
        "i8mm",
    }
)
# Hardware bf16 arithmetic; without it CPU autocast still runs bf16, but by converting to fp32.
_BF16_NATIVE_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16", "svebf16"})

_GIB = 1024**3


@dataclass(frozen=True)
class PeerLink:
    """Another GPU on this node and how this device reaches it: "nvlink", or the PCIe path ("PIX" ... "SYS")."""

    pci_bus_id: str
    link: str


@dataclass(frozen=True)
class DeviceFacts:
    """What one rank's device is. ``None`` means "could not be read" (see ``notes``) or "not applicable"."""

    kind: str  # "cuda" or "cpu"
    name: str
    hostname: str
    index: Optional[int] = None
    total_memory_bytes: Optional[int] = None
    free_memory_bytes: Optional[int] = None
    supports_bf16: Optional[bool] = None  # bf16 training runs (autocast or emulation count)
    bf16_native: Optional[bool] = None  # ... and the hardware computes in bf16, so it is fast
    supports_fp16: Optional[bool] = None
    # CUDA
    sm_count: Optional[int] = None
    compute_capability: Optional[tuple[int, int]] = None
    sm_clock_mhz: Optional[int] = None
    max_sm_clock_mhz: Optional[int] = None
    max_memory_clock_mhz: Optional[int] = None
    pci_bus_id: Optional[str] = None  # normalised, see normalize_pci_bus_id
    peers: Optional[tuple[PeerLink, ...]] = None
    # CPU
    physical_cores: Optional[int] = None
    logical_cpus: Optional[int] = None
    usable_cpus: Optional[int] = None  # CPUs this process may run on (affinity), which can be fewer than logical
    torch_threads: Optional[int] = None
    isa_features: tuple[str, ...] = ()
    torch_cpu_capability: Optional[str] = None  # the kernel set torch dispatches to, e.g. "AVX512"
    # provenance
    sources: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-native form (tuples as lists), so ``from_dict(json.loads(json.dumps(d)))`` gives back an equal value."""
        return _json_native(asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceFacts:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"DeviceFacts.from_dict got unknown keys {unknown}")
        values = dict(data)
        for key in ("isa_features", "sources", "notes"):
            if key in values:
                values[key] = tuple(values[key])
        if values.get("compute_capability") is not None:
            values["compute_capability"] = tuple(values["compute_capability"])
        if values.get("peers") is not None:
            values["peers"] = tuple(PeerLink(**peer) for peer in values["peers"])
        return cls(**values)

    def model_signature(self) -> tuple[Any, ...]:
        """The facts that make two devices the same model for speed: not where they are (host, index, bus), not
        what changes while they run (free memory, current clock), not how the facts were read."""
        return (
            self.kind,
            self.name,
            self.compute_capability,
            self.sm_count,
            self.max_sm_clock_mhz,
            self.max_memory_clock_mhz,
            self.usable_cpus,
            self.torch_threads,
            self.isa_features,
            self.torch_cpu_capability,
        )

    def describe(self) -> str:
        """One line for the plan table."""
        free_bytes = self.free_memory_bytes
        free = "free memory unknown" if free_bytes is None else f"{free_bytes / _GIB:.1f} GiB free"
        if self.kind == "cpu":
            count = self.torch_threads
            threads = "? threads" if count is None else f"{count} thread{'' if count == 1 else 's'}"
            return f"cpu: {threads}, {isa_summary(self.isa_features)} ({free})"
        details = [free] if self.sm_count is None else [f"{self.sm_count} SMs", free]
        return f"{self.name} ({', '.join(details)})"


def same_model(facts: Iterable[DeviceFacts]) -> bool:
    """Whether all these devices are the same model (:meth:`DeviceFacts.model_signature`)."""
    return len({f.model_signature() for f in facts}) <= 1


# ------------------------------------------------------------------------------------------------------------ helpers


def _read(
    query: Callable[[], _T],
    what: str,
    notes: list[str],
    default: Optional[_T] = None,
    errors: tuple[type[BaseException], ...] = (Exception,),
) -> Optional[_T]:
    """``query()``, or ``default`` with a note when it raises one of ``errors``."""
    try:
        return query()
    except errors as error:
        notes.append(f"{what} unavailable: {error}")
        return default


def _text(value: Union[str, bytes]) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _json_native(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _json_native(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_native(item) for item in value]
    return value


def isa_summary(flags: Iterable[str]) -> str:
    """The widest vector unit plus AMX when present, e.g. ``avx512f+amx``; ``baseline`` when none is known."""
    flags = set(flags)
    vector = next((name for name in ("avx512f", "avx2", "avx", "sve2", "sve", "asimd") if name in flags), None)
    parts: list[str] = [vector] if vector else []
    if "amx_tile" in flags:
        parts.append("amx")
    return "+".join(parts) or "baseline"
