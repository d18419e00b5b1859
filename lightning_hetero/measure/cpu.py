"""Measure: the facts of a CPU device: threads, memory, the ISA features that decide bf16 (procfs, psutil, torch)."""

from __future__ import annotations

import os
import platform
import socket
import warnings
from collections.abc import Iterable
from typing import Optional

import torch

from lightning_hetero.measure.facts import _BF16_NATIVE_FLAGS, ML_ISA_FEATURES, DeviceFacts, _read
from lightning_hetero.runtime.files import read_text

# ---------------------------------------------------------------------------------------------------------------- CPU


def cpu_facts() -> DeviceFacts:
    notes: list[str] = []
    sources = ["torch"]
    cpuinfo = read_text("/proc/cpuinfo")
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


def _cpu_autocast_accepts(dtype: torch.dtype) -> bool:
    # torch.autocast disables itself, with a warning, for a dtype the CPU backend does not support.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bool(getattr(torch.autocast("cpu", dtype=dtype), "_enabled", True))
