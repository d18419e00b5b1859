"""Device facts: the CPU path on this machine, the pure parsers, and the CUDA path against fake torch/NVML."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from lightning_hetero.measure import cpu as cpu_module
from lightning_hetero.measure import cuda as cuda_module
from lightning_hetero.measure import facts as facts_module
from lightning_hetero.measure.cpu import bf16_native, cpu_facts, parse_cpu_flags, parse_cpu_model
from lightning_hetero.measure.cuda import cuda_facts, normalize_pci_bus_id, pcie_link_name
from lightning_hetero.measure.devices import collect_device_facts
from lightning_hetero.measure.facts import DeviceFacts, PeerLink, isa_summary, same_model

SPR_FLAGS = (
    "fpu sse4_2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16 avx512_fp16"
    " amx_bf16 amx_tile amx_int8 sha_ni"
)
SAPPHIRE_RAPIDS_CPUINFO = f"""\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: {SPR_FLAGS}
bugs\t\t: spectre_v1

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: {SPR_FLAGS}
"""

SKYLAKE_FLAGS_LINE = "flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512dq avx512bw avx512vl\n"

GRAVITON3_CPUINFO = """\
processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes sha1 sha2 crc32 atomics fphp asimdhp sve i8mm bf16 svebf16
CPU implementer\t: 0x41
"""


# ------------------------------------------------------------------------------------------------- pure helpers


def test_parse_cpu_flags_reads_first_x86_flags_line_sorted_and_unique():
    flags = parse_cpu_flags(SAPPHIRE_RAPIDS_CPUINFO)
    assert flags == tuple(sorted(flags))
    assert len(flags) == len(set(flags))
    assert {"amx_tile", "amx_bf16", "avx512f", "avx512_bf16", "fma"} <= set(flags)
    assert "spectre_v1" not in flags  # the bugs line is not a flags line


def test_parse_cpu_flags_reads_arm_features_line():
    assert {"asimd", "sve", "bf16", "svebf16"} <= set(parse_cpu_flags(GRAVITON3_CPUINFO))


@pytest.mark.parametrize("text", ["", "processor\t: 0\nmodel name\t: mystery\n"])
def test_parse_cpu_flags_without_flags_line_is_empty(text):
    assert parse_cpu_flags(text) == ()


def test_parse_cpu_model():
    assert parse_cpu_model(SAPPHIRE_RAPIDS_CPUINFO) == "Intel(R) Xeon(R) Platinum 8480+"
    assert parse_cpu_model(GRAVITON3_CPUINFO) is None
    assert parse_cpu_model("") is None


def test_bf16_native_needs_hardware_bf16():
    assert bf16_native(parse_cpu_flags(SAPPHIRE_RAPIDS_CPUINFO))
    assert bf16_native(parse_cpu_flags(GRAVITON3_CPUINFO))
    assert not bf16_native(parse_cpu_flags(SKYLAKE_FLAGS_LINE))  # AVX-512 alone converts bf16 to fp32
    assert not bf16_native(())


def test_isa_summary_names_widest_vector_unit_and_amx():
    assert isa_summary(parse_cpu_flags(SAPPHIRE_RAPIDS_CPUINFO)) == "avx512f+amx"
    assert isa_summary(parse_cpu_flags(SKYLAKE_FLAGS_LINE)) == "avx512f"
    assert isa_summary(parse_cpu_flags(GRAVITON3_CPUINFO)) == "sve"
    assert isa_summary(["sse4_2"]) == "baseline"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("00000000:3B:00.0", "0000:3b:00.0"),  # NVML
        (b"00000000:3B:00.0\x00", "0000:3b:00.0"),  # NVML through ctypes
        ("0000:3b:00.0", "0000:3b:00.0"),  # torch / sysfs
        ("3b:00.0", "0000:3b:00.0"),  # no domain
        ("not-a-bus-id", "not-a-bus-id"),
    ],
)
def test_normalize_pci_bus_id(raw, expected):
    assert normalize_pci_bus_id(raw) == expected


def test_pcie_link_name_uses_nvidia_smi_names():
    assert pcie_link_name(10) == "PIX"
    assert pcie_link_name(50) == "SYS"
    assert pcie_link_name(99) == "level-99"


# ----------------------------------------------------------------------------------------------------- CPU path


def test_cpu_facts_on_this_machine_are_sane_and_round_trip_through_json():
    facts = collect_device_facts(torch.device("cpu"))
    assert facts.kind == "cpu" and facts.index is None
    assert facts.logical_cpus >= 1
    assert 1 <= facts.usable_cpus <= facts.logical_cpus
    assert facts.physical_cores is None or 1 <= facts.physical_cores <= facts.logical_cpus
    assert facts.torch_threads == torch.get_num_threads()
    assert facts.total_memory_bytes > 0
    assert 0 < facts.free_memory_bytes <= facts.total_memory_bytes
    assert facts.supports_bf16 is True  # CPU autocast has run bf16 since torch 1.10
    assert facts.isa_features == tuple(sorted(facts.isa_features))
    assert set(facts.isa_features) <= facts_module.ML_ISA_FEATURES
    assert "torch" in facts.sources
    assert re.match(r"cpu: \d+ threads?, ", facts.describe())
    assert "GiB free" in facts.describe()

    encoded = json.dumps(facts.to_dict())
    assert DeviceFacts.from_dict(json.loads(encoded)) == facts


A100 = DeviceFacts(
    kind="cuda",
    name="NVIDIA A100-SXM4-80GB",
    hostname="node-a",
    index=0,
    total_memory_bytes=80 * 2**30,
    free_memory_bytes=70 * 2**30,
    sm_count=108,
    compute_capability=(8, 0),
    sm_clock_mhz=1410,
    max_sm_clock_mhz=1410,
    max_memory_clock_mhz=1593,
    pci_bus_id="0000:07:00.0",
    sources=("torch", "nvml"),
)


@pytest.mark.parametrize(
    "changes",
    [
        {"hostname": "node-b", "index": 3, "pci_bus_id": "0000:b7:00.0"},  # where it is
        {"free_memory_bytes": 12 * 2**30, "sm_clock_mhz": 210},  # what changes while it runs
        {"sources": ("nvml",), "notes": ("torch cuda unavailable: ...",)},  # how the facts were read
        {"peers": (PeerLink("0000:0f:00.0", "nvlink"),)},
    ],
)
def test_same_model_ignores_place_state_and_provenance(changes):
    other = dataclasses.replace(A100, **changes)
    assert other.model_signature() == A100.model_signature()
    assert same_model([A100, other, A100])


@pytest.mark.parametrize(
    "changes",
    [
        {"name": "NVIDIA A100-PCIE-40GB"},
        {"sm_count": 98},  # a MIG slice or a cut-down part
        {"compute_capability": (8, 6)},
        {"max_sm_clock_mhz": 1095},  # a power-capped board
        {"kind": "cpu", "name": "Intel(R) Xeon(R) Platinum 8480+", "torch_threads": 8},
    ],
)
def test_same_model_tells_different_devices_apart(changes):
    other = dataclasses.replace(A100, **changes)
    assert not same_model([A100, other])
    assert same_model([other]) and same_model([])


def test_cpu_ranks_with_different_thread_counts_or_isa_are_different_models():
    cpu = cpu_facts()
    assert same_model([cpu, cpu_facts()])  # two ranks of this machine
    assert not same_model([cpu, dataclasses.replace(cpu, torch_threads=(cpu.torch_threads or 1) + 1)])
    assert not same_model([cpu, dataclasses.replace(cpu, isa_features=("avx2",))])


def test_cpu_facts_without_procfs_or_psutil_notes_what_is_missing(monkeypatch):
    monkeypatch.setattr(cpu_module, "read_text", lambda path: None)
    monkeypatch.setitem(sys.modules, "psutil", None)  # makes `import psutil` raise ImportError

    facts = cpu_facts()

    assert facts.isa_features == ()
    assert facts.total_memory_bytes is None and facts.free_memory_bytes is None
    assert facts.sources == ("torch",)
    assert any(note.startswith("procfs unavailable") for note in facts.notes)
    assert any(note.startswith("psutil unavailable") for note in facts.notes)
    assert facts.describe().endswith("(free memory unknown)")


def test_collect_device_facts_rejects_other_device_types():
    with pytest.raises(ValueError, match="meta"):
        collect_device_facts("meta")


def test_from_dict_rejects_unknown_keys():
    data = DeviceFacts(kind="cpu", name="x", hostname="h").to_dict()
    data["gpu_count"] = 8
    with pytest.raises(ValueError, match="gpu_count"):
        DeviceFacts.from_dict(data)


# ---------------------------------------------------------------------------------------------------- CUDA path

GIB = 1024**3
OWN_BUS, NVLINK_PEER_BUS, FAR_PEER_BUS = "00000000:3B:00.0", "00000000:1A:00.0", "00000000:AF:00.0"


def fake_cuda_properties(major: int = 9, minor: int = 0, with_pci: bool = True) -> SimpleNamespace:
    props = SimpleNamespace(
        name="NVIDIA H100 80GB HBM3", major=major, minor=minor, multi_processor_count=132, total_memory=80 * GIB
    )
    if with_pci:
        props.pci_domain_id, props.pci_bus_id, props.pci_device_id = 0, 0x3B, 0
    return props


@pytest.fixture
def fake_torch_cuda(monkeypatch):
    """Torch reports one H100 as cuda:0 whose PCI bus id is OWN_BUS."""
    props = fake_cuda_properties()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (70 * GIB, 80 * GIB))
    return props


@pytest.fixture
def broken_torch_cuda(monkeypatch):
    def fail(index):
        raise RuntimeError("No CUDA GPUs are available")

    monkeypatch.setattr(torch.cuda, "get_device_properties", fail)
    monkeypatch.setattr(torch.cuda, "mem_get_info", fail)


class FakeNVMLError(Exception):
    pass


def make_fake_nvml(init_fails: bool = False, clocks_unsupported: bool = False) -> types.ModuleType:
    """A pynvml stand-in for a node of three GPUs, numbered by NVML in PCI order (so our GPU is NVML index 1).

    Our GPU reaches 1A over NVLink and AF only across the CPU interconnect (SYS).
    """
    nvml = types.ModuleType("pynvml")
    nvml.calls = []
    nvml.NVMLError = FakeNVMLError
    nvml.NVML_CLOCK_SM, nvml.NVML_CLOCK_MEM = 1, 2
    nvml.NVML_P2P_CAPS_INDEX_NVLINK, nvml.NVML_P2P_STATUS_OK, not_supported = 2, 0, 4
    bus_ids = [NVLINK_PEER_BUS, OWN_BUS, FAR_PEER_BUS]

    def init():
        nvml.calls.append("init")
        if init_fails:
            raise FakeNVMLError("Driver Not Loaded")

    def clock(values):
        def read(handle, clock_type):
            if clocks_unsupported:
                raise FakeNVMLError("Not Supported")
            return values[clock_type]

        return read

    def p2p_status(a, b, index):
        assert index == nvml.NVML_P2P_CAPS_INDEX_NVLINK
        return nvml.NVML_P2P_STATUS_OK if {a, b} == {0, 1} else not_supported

    nvml.nvmlInit = init
    nvml.nvmlShutdown = lambda: nvml.calls.append("shutdown")
    nvml.nvmlDeviceGetCount = lambda: len(bus_ids)
    nvml.nvmlDeviceGetHandleByIndex = lambda index: index  # handles are the NVML indices
    nvml.nvmlDeviceGetPciInfo = lambda handle: SimpleNamespace(busId=bus_ids[handle].encode())
    nvml.nvmlDeviceGetName = lambda handle: b"NVIDIA H100 80GB HBM3"
    nvml.nvmlDeviceGetMemoryInfo = lambda handle: SimpleNamespace(total=80 * GIB, free=60 * GIB, used=20 * GIB)
    nvml.nvmlDeviceGetCudaComputeCapability = lambda handle: (9, 0)
    nvml.nvmlDeviceGetClockInfo = clock({1: 345, 2: 1593})  # idle
    nvml.nvmlDeviceGetMaxClockInfo = clock({1: 1980, 2: 2619})
    nvml.nvmlDeviceGetP2PStatus = p2p_status
    nvml.nvmlDeviceGetTopologyCommonAncestor = lambda a, b: 50  # NVML_TOPOLOGY_SYSTEM
    return nvml


def test_cuda_facts_without_pynvml_use_torch_and_say_nvml_is_unavailable(monkeypatch, fake_torch_cuda):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError

    facts = cuda_facts(0)

    assert facts.kind == "cuda" and facts.index == 0
    assert facts.name == "NVIDIA H100 80GB HBM3"
    assert facts.sm_count == 132
    assert facts.compute_capability == (9, 0)
    assert (facts.free_memory_bytes, facts.total_memory_bytes) == (70 * GIB, 80 * GIB)
    assert facts.supports_bf16 and facts.bf16_native and facts.supports_fp16
    assert facts.pci_bus_id == "0000:3b:00.0"
    assert facts.sm_clock_mhz is None and facts.max_sm_clock_mhz is None and facts.peers is None
    assert facts.sources == ("torch",)
    assert any(note.startswith("nvml unavailable") for note in facts.notes)
    assert facts.describe() == "NVIDIA H100 80GB HBM3 (132 SMs, 70.0 GiB free)"
    assert DeviceFacts.from_dict(json.loads(json.dumps(facts.to_dict()))) == facts


def test_cuda_facts_when_nvml_init_fails_degrade_to_torch(monkeypatch, fake_torch_cuda):
    nvml = make_fake_nvml(init_fails=True)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)

    facts = cuda_facts(0)

    assert nvml.calls == ["init"]  # nothing to shut down after a failed init
    assert facts.sm_count == 132 and facts.free_memory_bytes == 70 * GIB
    assert facts.max_sm_clock_mhz is None and facts.peers is None
    assert facts.sources == ("torch",)
    assert "nvml unavailable: Driver Not Loaded" in facts.notes


def test_cuda_facts_with_nvml_match_by_pci_bus_id_and_fill_clocks_and_topology(monkeypatch, fake_torch_cuda):
    nvml = make_fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)

    facts = cuda_facts(0)  # cuda:0 is NVML index 1: only the bus id finds it

    assert nvml.calls == ["init", "shutdown"]
    assert facts.pci_bus_id == "0000:3b:00.0"
    assert (facts.sm_clock_mhz, facts.max_sm_clock_mhz, facts.max_memory_clock_mhz) == (345, 1980, 2619)
    assert facts.peers == (PeerLink("0000:1a:00.0", "nvlink"), PeerLink("0000:af:00.0", "SYS"))
    assert facts.free_memory_bytes == 70 * GIB  # torch's view wins over NVML's 60 GiB
    assert facts.sources == ("torch", "nvml")
    assert facts.notes == ()
    assert DeviceFacts.from_dict(json.loads(json.dumps(facts.to_dict()))) == facts


def test_cuda_facts_without_torch_bus_id_match_nvml_by_index_with_a_note(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: fake_cuda_properties(with_pci=False))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (70 * GIB, 80 * GIB))
    monkeypatch.setitem(sys.modules, "pynvml", make_fake_nvml())

    facts = cuda_facts(0)

    assert facts.pci_bus_id == "0000:1a:00.0"  # NVML index 0, the best guess without a bus id
    assert any("matched by index 0" in note and "CUDA_VISIBLE_DEVICES" in note for note in facts.notes)


def test_cuda_facts_with_unsupported_clocks_keep_the_other_nvml_facts(monkeypatch, fake_torch_cuda):
    monkeypatch.setitem(sys.modules, "pynvml", make_fake_nvml(clocks_unsupported=True))

    facts = cuda_facts(0)

    assert facts.sm_clock_mhz is None and facts.max_sm_clock_mhz is None and facts.max_memory_clock_mhz is None
    assert len(facts.peers) == 2
    assert "nvml max sm clock unavailable: Not Supported" in facts.notes


def test_cuda_facts_when_torch_cuda_fails_come_from_nvml(monkeypatch, broken_torch_cuda):
    monkeypatch.setitem(sys.modules, "pynvml", make_fake_nvml())

    facts = cuda_facts(0)

    assert facts.name == "NVIDIA H100 80GB HBM3"
    assert facts.compute_capability == (9, 0)
    assert facts.free_memory_bytes == 60 * GIB
    assert facts.sm_count is None and facts.supports_bf16 is None
    assert facts.sources == ("nvml",)
    assert any(note.startswith("torch cuda unavailable") for note in facts.notes)
    assert facts.describe() == "NVIDIA H100 80GB HBM3 (60.0 GiB free)"


def test_cuda_facts_with_neither_torch_nor_nvml_still_return(monkeypatch, broken_torch_cuda):
    monkeypatch.setitem(sys.modules, "pynvml", None)

    facts = collect_device_facts("cuda:1")

    assert (facts.kind, facts.name, facts.index) == ("cuda", "cuda:1", 1)
    assert facts.sources == ()
    assert len(facts.notes) == 2
    assert facts.describe() == "cuda:1 (free memory unknown)"


def test_pre_ampere_gpu_runs_bf16_only_by_emulation(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: fake_cuda_properties(major=7, minor=0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (30 * GIB, 32 * GIB))
    monkeypatch.setattr(cuda_module, "_bf16_tensor_works", lambda index: True)
    monkeypatch.setitem(sys.modules, "pynvml", None)

    facts = cuda_facts(0)

    assert facts.supports_bf16 and not facts.bf16_native
    assert facts.supports_fp16


def test_collect_cuda_facts_on_this_machine_never_raises():
    facts = collect_device_facts("cuda")  # real torch and pynvml: works on a GPU host, notes why not elsewhere
    assert facts.kind == "cuda"
    assert facts.sm_count is not None or facts.notes
    json.dumps(facts.to_dict())
