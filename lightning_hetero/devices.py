"""Measure: static facts about the device this rank trains on.

The facts feed the split plan and its printed table, and travel between ranks as JSON, so they are a plain frozen
dataclass. Collecting them never raises because NVML, the driver or ``/proc`` is missing: what cannot be read is
left ``None`` and explained in ``notes``, and ``sources`` says what the rest came from.
"""

from __future__ import annotations

import os
import platform
import socket
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Optional, TypeVar, Union

import torch

_T = TypeVar("_T")

# CPU features that decide which kernels oneDNN / torch can use; the rest of /proc/cpuinfo's flags are noise here.
ML_ISA_FEATURES = frozenset(
    {
        # x86
        "sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni",
        "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16", "avx512_fp16",
        "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
        # arm64 ("Features" line)
        "asimd", "asimdhp", "sve", "sve2", "bf16", "svebf16", "i8mm",
    }
)  # fmt: skip
# Hardware bf16 arithmetic; without it CPU autocast still runs bf16, but by converting to fp32.
_BF16_NATIVE_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16", "svebf16"})

# NVML_TOPOLOGY_* levels (the closest common ancestor of two GPUs on the PCIe tree), named as `nvidia-smi topo -m`.
_PCIE_LINK_NAMES = {0: "same-board", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}

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


def collect_device_facts(device: Union[torch.device, str]) -> DeviceFacts:
    """Facts about ``device``; for ``cuda`` without an index, about the current CUDA device."""
    device = torch.device(device)
    if device.type == "cpu":
        return cpu_facts()
    if device.type == "cuda":
        index = device.index
        if index is None:
            # Without a working runtime there is no current device; cuda_facts(0) then notes why torch failed.
            index = _read(torch.cuda.current_device, "current cuda device", [], default=0)
        return cuda_facts(index)
    raise ValueError(f"Cannot describe device type {device.type!r}; expected 'cuda' or 'cpu'.")


# ---------------------------------------------------------------------------------------------------------------- CPU


def cpu_facts() -> DeviceFacts:
    notes: list[str] = []
    sources = ["torch"]
    cpuinfo = _read_text("/proc/cpuinfo")
    if cpuinfo is None:
        notes.append("procfs unavailable: /proc/cpuinfo not readable, no ISA features")
        cpuinfo = ""
    else:
        sources.append("procfs")
    flags = parse_cpu_flags(cpuinfo)
    physical_cores = total = free = None
    try:
        import psutil

        physical_cores = psutil.cpu_count(logical=False)
        memory = psutil.virtual_memory()
        total, free = memory.total, memory.available
        sources.append("psutil")
    except ImportError as error:
        notes.append(f"psutil unavailable: {error}; no memory or physical core count")
    logical = os.cpu_count()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical
    return DeviceFacts(
        kind="cpu",
        name=parse_cpu_model(cpuinfo) or platform.processor() or platform.machine() or "cpu",
        hostname=socket.gethostname(),
        total_memory_bytes=total,
        free_memory_bytes=free,
        supports_bf16=_cpu_autocast_accepts(torch.bfloat16),
        bf16_native=bf16_native(flags),
        supports_fp16=_cpu_autocast_accepts(torch.float16),
        physical_cores=physical_cores,
        logical_cpus=logical,
        usable_cpus=usable,
        torch_threads=torch.get_num_threads(),
        isa_features=tuple(sorted(ML_ISA_FEATURES.intersection(flags))),
        torch_cpu_capability=_read(torch.backends.cpu.get_cpu_capability, "torch cpu capability", notes),
        sources=tuple(sources),
        notes=tuple(notes),
    )


def parse_cpu_flags(cpuinfo_text: str) -> tuple[str, ...]:
    """The CPU flags of ``/proc/cpuinfo`` text, sorted: the x86 ``flags`` line or the arm64 ``Features`` line.

    Only the first processor's line is read: every core of a Linux host reports the same set.
    """
    for line in cpuinfo_text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return tuple(sorted(set(value.split())))
    return ()


def parse_cpu_model(cpuinfo_text: str) -> Optional[str]:
    for line in cpuinfo_text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            return value.strip()
    return None


def bf16_native(flags: Iterable[str]) -> bool:
    return not _BF16_NATIVE_FLAGS.isdisjoint(flags)


def isa_summary(flags: Iterable[str]) -> str:
    """The widest vector unit plus AMX when present, e.g. ``avx512f+amx``; ``baseline`` when none is known."""
    flags = set(flags)
    vector = next((name for name in ("avx512f", "avx2", "avx", "sve2", "sve", "asimd") if name in flags), None)
    parts = [vector] if vector else []
    if "amx_tile" in flags:
        parts.append("amx")
    return "+".join(parts) or "baseline"


def _cpu_autocast_accepts(dtype: torch.dtype) -> bool:
    # torch.autocast disables itself, with a warning, for a dtype the CPU backend does not support.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bool(getattr(torch.autocast("cpu", dtype=dtype), "_enabled", True))


# --------------------------------------------------------------------------------------------------------------- CUDA


def cuda_facts(index: int) -> DeviceFacts:
    """Facts about CUDA device ``index`` (as this process numbers it): torch first, NVML for clocks and topology.

    Torch's values win where both answer because they are what this process sees; NVML fills the rest, and stands in
    for torch when the CUDA runtime itself fails.
    """
    notes: list[str] = []
    sources: list[str] = []
    torch_fields = _torch_cuda_fields(index, notes)
    if torch_fields:
        sources.append("torch")
    nvml_fields = _nvml_cuda_fields(index, torch_fields.get("pci_bus_id"), notes)
    if nvml_fields:
        sources.append("nvml")
    merged = {**nvml_fields, **{key: value for key, value in torch_fields.items() if value is not None}}
    return DeviceFacts(
        kind="cuda",
        name=merged.pop("name", None) or f"cuda:{index}",
        hostname=socket.gethostname(),
        index=index,
        sources=tuple(sources),
        notes=tuple(notes),
        **merged,
    )


def _torch_cuda_fields(index: int, notes: list[str]) -> dict[str, Any]:
    try:
        props = torch.cuda.get_device_properties(index)
        free, total = torch.cuda.mem_get_info(index)
    except Exception as error:  # noqa: BLE001 - no driver, CPU-only torch, bad index: all mean "ask NVML instead"
        notes.append(f"torch cuda unavailable: {error}")
        return {}
    capability = (int(props.major), int(props.minor))
    native = capability >= (8, 0)
    pci_bus_id = _torch_pci_bus_id(props)
    if pci_bus_id is None:
        notes.append("torch reports no PCI bus id")
    return {
        "name": props.name,
        "sm_count": int(props.multi_processor_count),
        "compute_capability": capability,
        "total_memory_bytes": int(total),
        "free_memory_bytes": int(free),
        "supports_bf16": native or bool(torch.version.hip) or _bf16_tensor_works(index),
        "bf16_native": native,
        "supports_fp16": capability >= (5, 3),  # first architecture with half-precision arithmetic
        "pci_bus_id": pci_bus_id,
    }


def _torch_pci_bus_id(props: Any) -> Optional[str]:
    parts = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if any(part is None for part in parts):
        return None
    domain, bus, device = (int(part) for part in parts)
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


def _bf16_tensor_works(index: int) -> bool:
    # Pre-Ampere GPUs run bf16 by emulation when the runtime can make a bf16 tensor; the same test as torch's.
    try:
        torch.ones(1, dtype=torch.bfloat16, device=torch.device("cuda", index))
    except Exception:  # noqa: BLE001 - any failure means "no usable bf16"
        return False
    return True


def normalize_pci_bus_id(bus_id: Union[str, bytes]) -> str:
    """``domain:bus:device.function`` in lower case with a 4-digit domain, so NVML's ``00000000:3B:00.0`` and
    torch's ``0000:3b:00.0`` compare equal. Text that does not parse is only stripped and lower-cased."""
    text = bus_id.decode(errors="replace") if isinstance(bus_id, bytes) else bus_id
    text = text.strip().strip("\x00").lower()
    head, dot, function = text.rpartition(".")
    parts = head.split(":")
    if not dot or len(parts) not in (2, 3):
        return text
    if len(parts) == 2:
        parts.insert(0, "0")
    try:
        domain, bus, device = (int(part, 16) for part in parts)
        return f"{domain:04x}:{bus:02x}:{device:02x}.{int(function, 16):x}"
    except ValueError:
        return text


def pcie_link_name(topology_level: int) -> str:
    return _PCIE_LINK_NAMES.get(topology_level, f"level-{topology_level}")


def _nvml_cuda_fields(index: int, pci_bus_id: Optional[str], notes: list[str]) -> dict[str, Any]:
    try:
        import pynvml
    except ImportError as error:
        notes.append(f"nvml unavailable: {error}")
        return {}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        notes.append(f"nvml unavailable: {error}")
        return {}
    try:
        return _read_nvml(pynvml, index, pci_bus_id, notes)
    except pynvml.NVMLError as error:
        notes.append(f"nvml failed: {error}")
        return {}
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _read_nvml(nvml: Any, index: int, pci_bus_id: Optional[str], notes: list[str]) -> dict[str, Any]:
    # NVML numbers GPUs by PCI order and ignores CUDA_VISIBLE_DEVICES, so the CUDA index only matches by luck.
    devices = []
    for nvml_index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(nvml_index)
        devices.append((handle, normalize_pci_bus_id(nvml.nvmlDeviceGetPciInfo(handle).busId)))
    matches = [entry for entry in devices if pci_bus_id is not None and entry[1] == pci_bus_id]
    if matches:
        handle, own_bus_id = matches[0]
    elif index < len(devices):
        handle, own_bus_id = devices[index]
        reason = "torch gave no PCI bus id" if pci_bus_id is None else f"no NVML device has PCI bus id {pci_bus_id}"
        notes.append(f"nvml device matched by index {index} ({reason}); wrong if CUDA_VISIBLE_DEVICES reorders GPUs")
    else:
        notes.append(f"nvml has no device for cuda:{index} ({len(devices)} devices)")
        return {}

    def read(what: str, query: Callable[[], _T]) -> Optional[_T]:
        return _read(query, f"nvml {what}", notes, errors=(nvml.NVMLError,))

    memory = read("memory", lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
    capability = read("compute capability", lambda: nvml.nvmlDeviceGetCudaComputeCapability(handle))
    sm, mem = nvml.NVML_CLOCK_SM, nvml.NVML_CLOCK_MEM
    return {
        "name": read("name", lambda: _text(nvml.nvmlDeviceGetName(handle))),
        "pci_bus_id": own_bus_id,
        "total_memory_bytes": None if memory is None else int(memory.total),
        "free_memory_bytes": None if memory is None else int(memory.free),
        "compute_capability": None if capability is None else (int(capability[0]), int(capability[1])),
        "sm_clock_mhz": read("sm clock", lambda: int(nvml.nvmlDeviceGetClockInfo(handle, sm))),
        "max_sm_clock_mhz": read("max sm clock", lambda: int(nvml.nvmlDeviceGetMaxClockInfo(handle, sm))),
        "max_memory_clock_mhz": read("max memory clock", lambda: int(nvml.nvmlDeviceGetMaxClockInfo(handle, mem))),
        "peers": tuple(
            PeerLink(bus_id, _link_kind(nvml, handle, other))
            for other, bus_id in sorted(devices, key=lambda entry: entry[1])
            if bus_id != own_bus_id
        ),
    }


def _link_kind(nvml: Any, handle: Any, other: Any) -> str:
    # P2P over NVLink covers direct links and NVSwitch alike; per-link remote ids would name the switch instead.
    try:
        if nvml.nvmlDeviceGetP2PStatus(handle, other, nvml.NVML_P2P_CAPS_INDEX_NVLINK) == nvml.NVML_P2P_STATUS_OK:
            return "nvlink"
    except nvml.NVMLError:
        pass
    try:
        return pcie_link_name(int(nvml.nvmlDeviceGetTopologyCommonAncestor(handle, other)))
    except nvml.NVMLError:
        return "unknown"


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


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            return file.read()
    except OSError:
        return None


def _text(value: Union[str, bytes]) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _json_native(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _json_native(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_native(item) for item in value]
    return value
