"""The machine the numbers come from: CPU model, the ISA extensions our kernels use, cores, threads, OS,
library versions, and the ISA that torch, oneDNN and numpy were allowed to use.

Absolute times differ by machine (a decode step on an AVX-512 CPU takes half as long as on an AVX2-only
one); ratios measured in one run hold. So bench results, the gate report and the build manifest (whose
step costs are measured at build) carry this record next to their numbers.

Linux: /proc/cpuinfo. Elsewhere: the platform module and numpy's CPU report fill in what they can.
`describe_machine` never raises; a field it cannot learn is None.
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import subprocess
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Optional

from specpipe import __version__

CPUINFO = "/proc/cpuinfo"
# The libraries whose versions a build, a bench run and a gate report record.
LIBRARIES = ("torch", "transformers", "optimum-onnx", "onnx", "onnxruntime", "numpy", "tritonclient", "nvidia-pytriton")

# /proc/cpuinfo flag -> the name people use, in the order summary() prints them.
ISA_FLAGS = {
    "avx2": "AVX2",
    "fma": "FMA",
    "avx512f": "AVX-512F",
    "avx512_vnni": "AVX512-VNNI",
    "avx512_bf16": "AVX512-BF16",
    "amx_tile": "AMX-TILE",
    "amx_bf16": "AMX-BF16",
    "avx_vnni": "AVX-VNNI",
}
# numpy's names for the flags it detects itself (the fallback off Linux); it knows no BF16, AMX or AVX-VNNI.
_NUMPY_NAMES = {"avx2": "AVX2", "fma": "FMA3", "avx512f": "AVX512F", "avx512_vnni": "AVX512VNNI"}

# Environment variables that cap or force the ISA a library dispatches to, or its thread count.
KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "NPY_DISABLE_CPU_FEATURES",
              "OMP_NUM_THREADS", "MKL_NUM_THREADS")
_VERSIONS = ("torch", "onnxruntime", "numpy")
_VENDORS = {"GenuineIntel": "Intel", "AuthenticAMD": "AMD"}


@dataclass
class CpuInfo:
    """What /proc/cpuinfo says. flags is None when the text has no flags line (not x86, or not Linux)."""

    model: Optional[str]
    vendor: Optional[str]
    flags: Optional[frozenset[str]]
    physical_cores: Optional[int]
    logical_cores: Optional[int]


def parse_cpuinfo(text: str) -> CpuInfo:
    """Parse /proc/cpuinfo: one block per logical CPU, `key : value` lines.

    Physical cores = distinct (physical id, core id) pairs; without those, `cpu cores` per package."""
    blocks = [dict(_fields(block)) for block in re.split(r"\n\s*\n", text) if block.strip()]
    blocks = [b for b in blocks if "processor" in b]
    if not blocks:
        return CpuInfo(None, None, None, None, None)
    first = blocks[0]
    vendor = first.get("vendor_id") or first.get("CPU implementer")
    flags = first.get("flags")
    cores = {(b["physical id"], b["core id"]) for b in blocks if "physical id" in b and "core id" in b}
    if cores:
        physical = len(cores)
    elif first.get("cpu cores", "").isdigit():
        physical = int(first["cpu cores"]) * len({b.get("physical id", "0") for b in blocks})
    else:
        physical = None
    return CpuInfo(
        model=first.get("model name") or first.get("Model name") or first.get("Hardware"),
        vendor=_VENDORS.get(vendor, vendor),
        flags=frozenset(flags.split()) if flags is not None else None,
        physical_cores=physical,
        logical_cores=len(blocks),
    )


def _fields(block: str):
    for line in block.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            yield key.strip(), value.strip()


@dataclass
class Machine:
    """The record `as_dict()` writes into bench JSON, the gate report and the build manifest."""

    cpu_model: Optional[str]
    vendor: Optional[str]  # "Intel", "AMD", or the raw vendor id
    arch: str  # platform.machine(): x86_64, arm64, ...
    isa: dict[str, Optional[bool]]  # ISA_FLAGS key -> present; None = could not tell on this OS
    physical_cores: Optional[int]
    logical_cores: Optional[int]
    usable_cpus: Optional[int]  # CPUs this process may run on (a container or taskset may allow fewer)
    threads: dict  # in_use (what the numbers ran with: ORT intra-op threads), torch, omp_num_threads
    os: str
    versions: dict[str, str]  # python, torch, onnxruntime, numpy
    kernels: dict  # what the libraries will use: torch_cpu_capability, numpy_cpu_features, onnxruntime_providers
    isa_env: dict[str, str] = field(default_factory=dict)  # KERNEL_ENV variables that are set
    source: str = "platform"  # where the CPU facts came from: /proc/cpuinfo | platform

    def summary(self) -> str:
        """One line, e.g. "AMD EPYC 7B13 (AVX2, FMA; no AVX-512), 2 cores, 2 threads"."""
        model = re.sub(r"\s+", " ", re.sub(r"\((R|TM|tm)\)", "", self.cpu_model or self.arch or "unknown CPU")).strip()
        present = [name for flag, name in ISA_FLAGS.items() if self.isa.get(flag)]
        if all(value is None for value in self.isa.values()):
            isa = "ISA flags unknown"
        else:
            isa = ", ".join(present) or "none of AVX2/FMA/AVX-512"
            if self.isa.get("avx512f") is False and present:
                isa += "; no AVX-512"
        line = f"{model} ({isa})"
        cores, logical = self.physical_cores, self.logical_cores
        if cores:
            line += f", {cores} core{'s' * (cores != 1)}" + (f" ({logical} logical)" if logical and logical != cores else "")
        elif logical:
            line += f", {logical} logical CPUs"
        if self.usable_cpus and self.logical_cores and self.usable_cpus < self.logical_cores:
            line += f", {self.usable_cpus} usable"
        if self.threads.get("in_use"):
            line += f", {self.threads['in_use']} threads"
        capped = {k: v for k, v in self.isa_env.items() if not k.endswith("_NUM_THREADS")}
        if capped:
            line += "; ISA capped by " + " ".join(f"{k}={shlex.quote(v)}" for k, v in capped.items())
        return line

    def as_dict(self) -> dict:
        return {"summary": self.summary(), **asdict(self)}


def library_versions(libraries=LIBRARIES) -> dict[str, str]:
    """Python's, specpipe's and each installed library's version (one not installed is left out)."""
    versions = {"python": platform.python_version(), "specpipe": __version__}
    for lib in libraries:
        try:
            versions[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            pass
    return versions


def describe_machine(threads: Optional[int] = None, cpuinfo_path: str = CPUINFO) -> Machine:
    """This machine. `threads`: the intra-op thread count the measurements use (default: torch's)."""
    cpu = _read_cpuinfo(cpuinfo_path)
    source = cpuinfo_path if cpu is not None else "platform"
    numpy_features = _numpy_features()
    if cpu is None:
        cpu = CpuInfo(_platform_model(), None, None, _psutil_physical_cores(), os.cpu_count())
    isa = {flag: (flag in cpu.flags) if cpu.flags is not None else None for flag in ISA_FLAGS}
    if cpu.flags is None and numpy_features:
        isa.update({flag: bool(numpy_features.get(name)) for flag, name in _NUMPY_NAMES.items()})
    torch_threads, capability = _torch_facts()
    return Machine(
        cpu_model=cpu.model,
        vendor=cpu.vendor,
        arch=platform.machine(),
        isa=isa,
        physical_cores=cpu.physical_cores,
        logical_cores=cpu.logical_cores,
        usable_cpus=usable_cpus(),
        threads={"in_use": threads if threads is not None else torch_threads, "torch": torch_threads,
                 "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
        os=platform.platform(),
        versions=library_versions(_VERSIONS),
        kernels={
            "torch_cpu_capability": capability,  # honours ATEN_CPU_CAPABILITY
            "numpy_cpu_features": _numpy_dispatch(numpy_features),  # honours NPY_DISABLE_CPU_FEATURES
            "onnxruntime_providers": _ort_providers(),  # MLAS picks its kernels at run time and does not say which
        },
        isa_env={name: os.environ[name] for name in KERNEL_ENV if os.environ.get(name)},
        source=source,
    )


# Each helper below answers None when it cannot tell: describing the machine must never fail a run.


def _read_cpuinfo(path: str) -> Optional[CpuInfo]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            cpu = parse_cpuinfo(f.read())
    except Exception:  # unreadable, or text this parser does not know
        return None
    return cpu if cpu.logical_cores else None


def _platform_model() -> Optional[str]:
    if platform.system() == "Darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                 timeout=2, check=True)
            return out.stdout.strip() or None
        except Exception:
            pass
    return platform.processor() or None


def _psutil_physical_cores() -> Optional[int]:
    try:
        import psutil

        return psutil.cpu_count(logical=False)
    except Exception:
        return None


def available_memory_bytes(meminfo: str = "/proc/meminfo") -> Optional[int]:
    """The kernel's MemAvailable: memory new work can take now without swapping. None where it cannot be read."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def usable_cpus() -> Optional[int]:
    """The CPUs this process may run on (its affinity), else the machine's count; None when neither is known."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def _torch_facts() -> tuple[Optional[int], Optional[str]]:
    try:
        import torch

        return torch.get_num_threads(), torch.backends.cpu.get_cpu_capability()
    except Exception:
        return None, None


def numpy_cpu_tables() -> Optional[tuple[dict, list[str], list[str]]]:
    """numpy's run-time CPU tables: (feature -> available after NPY_DISABLE_CPU_FEATURES, baseline
    targets, dispatch targets); None where this numpy does not expose them."""
    try:
        try:
            from numpy._core import _multiarray_umath as tables  # numpy >= 2
        except ImportError:
            from numpy.core import _multiarray_umath as tables
        return dict(tables.__cpu_features__), list(tables.__cpu_baseline__), list(tables.__cpu_dispatch__)
    except Exception:
        return None


def _numpy_features() -> Optional[dict]:
    tables = numpy_cpu_tables()
    return tables[0] if tables else None


def _numpy_dispatch(features: Optional[dict]) -> Optional[list[str]]:
    """The SIMD targets numpy was built to dispatch to that it will use here."""
    tables = numpy_cpu_tables()
    if features is None or tables is None:
        return None
    return [name for name in (*tables[1], *tables[2]) if features.get(name)]


def _ort_providers() -> Optional[list[str]]:
    try:
        import onnxruntime

        return list(onnxruntime.get_available_providers())
    except Exception:
        return None
