"""The engine follows the machine: bf16 where it is native (a GPU, or a CPU with bf16 instructions), fp32
elsewhere, where PyTorch computes bf16 in a slow fallback; on a CPU with few cores it computes on all of them,
with threads that sleep while they wait."""
from __future__ import annotations

import json
import os
import re

import psutil
import pytest

from lightning_otel.serve.engine import SMALL_MACHINE_CORES, EngineConfig, VLLMEngine, engine_cpu_env, native_bf16
from lightning_otel.errors import UserError

# /proc/cpuinfo lines as Linux writes them (flags abridged to the vector extensions and their neighbours).
AVX2_X86 = "flags\t\t: fpu vme sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2 rdseed adx sha_ni\n"
AVX512_NO_BF16 = "flags\t\t: fpu sse2 avx avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni\n"
SAPPHIRE_RAPIDS = ("flags\t\t: fpu sse2 avx avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8\n")
AMX_ONLY = "flags\t\t: fpu sse2 avx avx2 amx_bf16 amx_tile\n"
NEOVERSE_V1 = "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp sve i8mm bf16 dgh\n"
CORTEX_A72 = "Features\t: fp asimd evtstrm crc32 cpuid\n"


@pytest.mark.parametrize("cpuinfo, expected", [
    (AVX2_X86, False), (AVX512_NO_BF16, False), (SAPPHIRE_RAPIDS, True), (AMX_ONLY, True),
    (NEOVERSE_V1, True), (CORTEX_A72, False), ("", False),
    # two processors listed, the second with the flag: any listed processor counts
    ("processor\t: 0\n" + AVX2_X86 + "\nprocessor\t: 1\n" + SAPPHIRE_RAPIDS, True),
    # a name that merely contains the letters is not the flag
    ("flags\t\t: avx2 notbf16 bf16x\nmodel name\t: bf16 emulator\n", False),
])
def test_native_bf16_reads_the_cpu_flags(cpuinfo, expected):
    assert native_bf16(cpuinfo, gpu=False) is expected


def test_a_gpu_makes_bf16_native_whatever_the_cpu():
    assert native_bf16(AVX2_X86, gpu=True) is True


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return tmp_path


def test_auto_dtype_is_bf16_only_where_native(model_dir):
    config = EngineConfig(model_dir=model_dir)
    assert config.dtype == ("bfloat16" if native_bf16() else "float32")
    command = VLLMEngine(config).command()
    assert command[command.index("--dtype") + 1] == config.dtype


def test_an_explicit_dtype_is_kept_and_a_wrong_one_says_what_to_use(model_dir):
    assert EngineConfig(model_dir=model_dir, dtype="bfloat16").dtype == "bfloat16"
    assert EngineConfig(model_dir=model_dir, dtype="float32").dtype == "float32"
    with pytest.raises(UserError, match=r"'fp32'.*auto, bfloat16, float16, float32"):
        EngineConfig(model_dir=model_dir, dtype="fp32")


def test_the_running_engine_computes_in_the_chosen_precision(engine):
    """The shared real engine (conftest) was started with the default: vLLM's own log says what it loaded."""
    assert engine.config.dtype == ("bfloat16" if native_bf16() else "float32")
    loaded = set(re.findall(r"dtype=torch\.(\w+)", engine.config.log_path.read_text()))
    assert loaded == {engine.config.dtype}


SMALL = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_WAIT_POLICY": "PASSIVE"}


@pytest.mark.parametrize("environ, cores, gpu, expected", [
    ({}, 2, False, SMALL),
    ({}, SMALL_MACHINE_CORES, False, SMALL),
    ({}, SMALL_MACHINE_CORES + 1, False, {}),  # vLLM's own defaults: one core for its scheduler, spinning threads
    ({}, 2, True, {}),  # a GPU engine has no CPU threads to place
    ({"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}, 2, False, {"OMP_WAIT_POLICY": "PASSIVE"}),  # the user's setting wins
    ({"VLLM_CPU_OMP_THREADS_BIND": "0"}, 2, False, {"OMP_WAIT_POLICY": "PASSIVE"}),
    ({"VLLM_CPU_OMP_THREADS_BIND": "auto"}, 2, False, SMALL),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, 2, False, {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}),
])
def test_a_cpu_engine_keeps_no_core_back_and_sleeps_while_waiting_on_a_small_machine(environ, cores, gpu, expected):
    assert engine_cpu_env(environ, cores=cores, gpu=gpu) == expected


def test_the_running_engine_computes_on_every_core_of_a_small_machine(engine):
    """vLLM's log of the shared engine says how many cores it kept back for its scheduler, and the engine
    process's environment says how its threads wait."""
    settings = engine_cpu_env()
    if "VLLM_CPU_NUM_OF_RESERVED_CPU" not in settings:
        pytest.skip(f"a GPU, more than {SMALL_MACHINE_CORES} cores, or VLLM_CPU_* set: vLLM places its threads")
    assert set(re.findall(r"reserve_cpu_num=(\d+)", engine.config.log_path.read_text())) == {"0"}
    environ = psutil.Process(engine.process.pid).environ()
    assert environ.get("OMP_WAIT_POLICY") == settings.get("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY"))


@pytest.mark.parametrize("setting", ["autocast", "bf16"])
def test_the_trainer_warns_about_bf16_on_a_machine_without_it(tmp_path, setting):
    from lightning_otel.train.config import TrainConfig
    from lightning_otel.train.learner import slow_bf16_warning
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"question": "How many singers are there?", "db_id": "singer"}) + "\n")
    config = TrainConfig(tasks=str(tasks), agent="python agent.py --question {question}",
                         output_dir=str(tmp_path / "run"), **{setting: True})
    warning = slow_bf16_warning(config, native=False)
    assert warning and f"Set {setting} = false" in warning
    assert slow_bf16_warning(config, native=True) is None
    plain = TrainConfig(tasks=str(tasks), agent="python agent.py --question {question}", output_dir=str(tmp_path))
    assert slow_bf16_warning(plain, native=False) is None
