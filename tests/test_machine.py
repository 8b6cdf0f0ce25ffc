"""specpipe.machine: /proc/cpuinfo of an AVX-512 Intel and an AVX2-only AMD, fallbacks, the one-line summary."""

from __future__ import annotations

import json

from specpipe import machine as machine_module
from specpipe.machine import ISA_FLAGS, Machine, describe_machine, parse_cpuinfo

# 2 vCPUs = 1 core with 2 hyperthreads (a cloud Sapphire Rapids; flags line shortened to the x86 basics plus
# every AVX-512/AMX flag the kernel prints there).
INTEL_AVX512 = """\
processor	: {n}
vendor_id	: GenuineIntel
cpu family	: 6
model		: 143
model name	: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
physical id	: 0
siblings	: 2
core id		: 0
cpu cores	: 1
flags		: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ss ht \
syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid tsc_known_freq pni pclmulqdq ssse3 \
fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm abm 3dnowprefetch \
ssbd ibrs ibpb stibp fsgsbase tsc_adjust bmi1 hle avx2 smep bmi2 erms invpcid rtm avx512f avx512dq rdseed adx smap \
avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves avx_vnni avx512_bf16 \
arat avx512vbmi umip pku ospke waitpkg avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq \
rdpid cldemote movdiri movdir64b fsrm md_clear serialize tsxldtrk amx_bf16 avx512_fp16 amx_tile amx_int8 arch_capabilities
bogomips	: 5399.99

"""

# 2 vCPUs = 2 cores, no hyperthreads (a Zen 3 EPYC: AVX2 + FMA, no AVX-512).
AMD_AVX2 = """\
processor	: {n}
vendor_id	: AuthenticAMD
cpu family	: 25
model		: 1
model name	: AMD EPYC 7B13
physical id	: 0
siblings	: 2
core id		: {n}
cpu cores	: 2
flags		: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht \
syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid extd_apicid \
tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand \
hypervisor lahf_lm cmp_legacy cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw topoext ssbd ibrs ibpb stibp \
vmmcall fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid rdseed adx smap clflushopt clwb sha_ni xsaveopt xsavec \
xgetbv1 xsaves clzero xsaveerptr wbnoinvd arat umip pku ospke vaes vpclmulqdq rdpid fsrm
bogomips	: 4899.99

"""

# An arm64 board: no model name, no x86 flags line.
ARM = """\
processor	: {n}
BogoMIPS	: 48.00
Features	: fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid
CPU implementer	: 0x41
CPU part	: 0xd0c

"""


def _cpuinfo(block: str, cpus: int = 2) -> str:
    return "".join(block.format(n=n) for n in range(cpus))


def _machine(tmp_path, block: str, threads: int = 2) -> Machine:
    path = tmp_path / "cpuinfo"
    path.write_text(_cpuinfo(block))
    return describe_machine(threads=threads, cpuinfo_path=str(path))


def test_intel_avx512_with_amx(tmp_path):
    cpu = parse_cpuinfo(_cpuinfo(INTEL_AVX512))
    assert cpu.vendor == "Intel" and cpu.model == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert (cpu.physical_cores, cpu.logical_cores) == (1, 2)  # one core, two hyperthreads
    machine = _machine(tmp_path, INTEL_AVX512)
    assert all(machine.isa.values()), machine.isa  # every flag we track, AMX and AVX-VNNI included
    assert machine.summary() == ("Intel Xeon Platinum 8481C CPU @ 2.70GHz (AVX2, FMA, AVX-512F, AVX512-VNNI, "
                                 "AVX512-BF16, AMX-TILE, AMX-BF16, AVX-VNNI), 1 core (2 logical), 2 threads")


def test_amd_avx2_only(tmp_path):
    cpu = parse_cpuinfo(_cpuinfo(AMD_AVX2))
    assert cpu.vendor == "AMD" and cpu.model == "AMD EPYC 7B13"
    assert (cpu.physical_cores, cpu.logical_cores) == (2, 2)
    machine = _machine(tmp_path, AMD_AVX2)
    assert {flag for flag, present in machine.isa.items() if present} == {"avx2", "fma"}
    assert machine.source.endswith("cpuinfo")
    assert machine.summary() == "AMD EPYC 7B13 (AVX2, FMA; no AVX-512), 2 cores, 2 threads"


def test_no_flags_line_means_unknown_not_absent(tmp_path, monkeypatch):
    cpu = parse_cpuinfo(_cpuinfo(ARM, cpus=4))
    assert cpu.flags is None and cpu.logical_cores == 4 and cpu.physical_cores is None
    monkeypatch.setattr(machine_module, "_numpy_features", lambda: None)  # numpy's report is the next source
    machine = _machine(tmp_path, ARM)
    assert machine.isa == {flag: None for flag in ISA_FLAGS}
    assert "(ISA flags unknown)" in machine.summary()


def test_without_cpuinfo_it_falls_back_and_never_fails(tmp_path):
    machine = describe_machine(threads=3, cpuinfo_path=str(tmp_path / "missing"))
    assert machine.source == "platform"
    assert machine.threads["in_use"] == 3 and machine.arch
    assert machine.summary().endswith("3 threads")
    assert parse_cpuinfo("").logical_cores is None
    assert parse_cpuinfo("processor : 0\ncpu cores : many\n").physical_cores is None


def test_record_is_json_with_what_the_libraries_use(tmp_path, monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("NPY_DISABLE_CPU_FEATURES", "AVX512F AVX512_SKX")
    record = json.loads(json.dumps(_machine(tmp_path, AMD_AVX2).as_dict()))
    for key in ("summary", "cpu_model", "vendor", "isa", "physical_cores", "logical_cores", "threads", "os",
                "versions", "kernels", "isa_env"):
        assert key in record
    assert set(record["versions"]) >= {"python", "torch", "onnxruntime", "numpy"}
    assert record["isa_env"]["ATEN_CPU_CAPABILITY"] == "avx2"
    assert record["kernels"]["torch_cpu_capability"]  # torch reads the variable at import: any value here
    assert record["summary"].endswith("ISA capped by ATEN_CPU_CAPABILITY=avx2 NPY_DISABLE_CPU_FEATURES='AVX512F AVX512_SKX'")
