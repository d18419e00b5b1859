"""Measure: the facts of a CUDA device: torch first, NVML for clocks and topology; a failing driver or a missing NVML
leaves fields ``None`` with a note instead of raising."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any, Optional, Union

import torch

from lightning_hetero.measure.facts import _T, DeviceFacts, PeerLink, _read, _text

# NVML_TOPOLOGY_* levels (the closest common ancestor of two GPUs on the PCIe tree), named as `nvidia-smi topo -m`.
_PCIE_LINK_NAMES = {0: "same-board", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


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
    parts: list[Any] = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
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
