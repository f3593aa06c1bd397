"""The rollout runner: run an unchanged agent command over a task file, n samples per task.

    lightning-otel rollout --tasks dev.jsonl --agent "python agent.py --question {question} --db {db_path}" \\
        -n 4 --concurrency 2 --db traces.duckdb --reward spider_exec

With no --base-url, the runner serves the policy (the bundled model, or --model: a run, checkpoint, adapter or
model folder) with the vLLM engine behind the token-recording gateway, and points each agent at its own
gateway prefix. With --base-url (an outside OpenAI-compatible endpoint: a closed model), the gateway forwards each
agent's chat calls there instead, applying the prompt patch, the temperature and the token cap, and records them
as text (lightning_otel.serve.forward; no token ids, so no training on them).

Each rollout is a subprocess under `opentelemetry-instrument` with our distro, given (DESIGN §7):
OPENAI_BASE_URL, OPENAI_API_KEY, OTEL_RESOURCE_ATTRIBUTES (lightning.rollout.id, lightning.task.id,
lightning.attempt), LIGHTNING_MODEL and the collector's address. Placeholders in the command are task
fields, {model}, {rollout_id}, {attempt}, {task_id}, and what the task pack prepares for each rollout (the
spider pack's {db_path}: a fresh copy of the task's database, so model-written SQL cannot damage shared
files; lightning_otel.rollouts.packs). Every rollout ends as a `rollout_runs` row
(ok, failed, timeout or error) with its exit code, output tails and final output line; the reward
function, if any, then scores it into `rewards`. Problems with the inputs are reported before any
rollout starts.

Agent functions (`agent="module:function"` or `"path/to/file.py:function"`, no spaces; anything else is a
command): each rollout is a call `fn(task, llm)` in ONE long-lived worker process under
opentelemetry-instrument, many at a time (lightning_otel.rollouts.inprocess, lightning_otel.capture.agent_worker),
instead of a process per rollout. `task` is the task's fields plus what the task pack prepared ({db_path});
`llm` (lightning_otel.LLM) carries the rollout's gateway URL, API key, model name and ids. The call runs
inside lightning_otel.rollout(), so its spans carry the rollout's ids as span attributes, where a
subprocess's carry them as resource attributes; the store, the rows and the rewards are the same.
`final_output` is the return value (its last non-empty line), the output tails what the call printed.

Scripted answers (`answers`, through the gateway only): call i of every rollout is answered with template i
formatted from the task's fields (str.format), and calls past the last template are refused: the agent walks a
labelled path, and its prompts along it are recorded (the SFT warm start's demonstrations).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from lightning_otel.capture.agent_fn import AgentFunction, load_agent_function, parse_agent_function
from lightning_otel.capture.context import new_rollout_id
from lightning_otel.errors import UserError
from lightning_otel.lifetime import parent_death_signal
from lightning_otel.rollouts.environment import agent_environment, capture_environment
from lightning_otel.rollouts.packs import TaskPack, load_pack, pack_for_reward, pack_names
from lightning_otel.rollouts.rewards import call_reward, resolve_reward
from lightning_otel.serve.engine import PolicyEngine
from lightning_otel.serve.prompts import PromptPatches, load_patches
from lightning_otel.serve.toolcalls import tool_format as known_tool_format

if TYPE_CHECKING:
    from lightning_otel.rollouts.inprocess import AgentWorker
    from lightning_otel.span_store.discovery import CollectorInfo

log = logging.getLogger(__name__)
PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
RUNNER_NAMES = {"model", "rollout_id", "attempt", "task_id"}
TAIL_CHARS = 4000


@dataclass
class RolloutConfig:
    tasks: Path
    agent: str
    n: int = 4
    concurrency: int = 2
    db: Path = Path("traces.duckdb")
    base_url: str | None = None  # an outside OpenAI-compatible endpoint the gateway forwards to (closed models)
    api_key: str | None = None  # OPENAI_API_KEY given to the agents (with base_url, forwarded unless api_key_env)
    api_key_env: str | None = None  # with base_url: the environment variable holding the endpoint's key
    base_model: str | None = None  # with base_url: the model name sent there (and given to the agents as {model})
    model: str | None = None
    model_name: str = "policy"
    reward: str | None = None
    task_pack: str | TaskPack | None = None  # default: the pack that registers `reward` (rollouts.packs)
    data_dir: Path | None = None  # the task pack's data folder (default: the pack's own)
    rollout_timeout_s: float = 300.0  # seconds one rollout may run before it is killed
    work_dir: Path | None = None
    max_tokens: int | None = None  # cap on every generation through the gateway
    temperature: float | None = None  # sampling temperature forced on every request through the gateway
    max_calls: int | None = None  # model calls per rollout through the gateway; later ones are refused
    answers: list[str] | None = None  # scripted answers, one template per model call (module docstring)
    chat_template: Path | None = None  # a Jinja chat template file the gateway renders prompts with
    tool_format: str | None = None  # the call syntax (serve.toolcalls.FORMATS); None: detected from the template
    prompt: Path | None = None  # a prompt patch file the gateway applies (serve.prompts; docs/prompts.md)
    # one adapter per agent: {name: agent regex}; the gateway serves each call by its agent's adapter (the engine
    # must have them loaded: PolicyEngine.update_adapters), calls of no adapter by the base model
    adapters: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tasks, self.db = Path(self.tasks), Path(self.db)
        self.pack: TaskPack | None = self.task_pack if isinstance(self.task_pack, TaskPack) \
            else pack_for_reward(self.reward, self.task_pack)
        self.data_dir = Path(self.data_dir) if self.data_dir else (self.pack.default_data_dir() if self.pack else None)
        if self.n < 1:
            raise UserError(f"n = {self.n}: the number of samples per task must be at least 1")
        if self.concurrency < 1:
            raise UserError(f"concurrency = {self.concurrency}: run at least 1 rollout at a time")
        if self.rollout_timeout_s <= 0:
            raise UserError(f"rollout_timeout_s = {self.rollout_timeout_s}: give the seconds one rollout may run (> 0)")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise UserError(f"max_tokens {self.max_tokens} must be at least 1")
        if self.max_calls is not None and self.max_calls < 1:
            raise UserError(f"max_calls {self.max_calls} must be at least 1")
        if self.answers is not None:
            if not self.answers or not all(isinstance(a, str) for a in self.answers):
                raise UserError(f"answers {self.answers!r}: give a non-empty list of texts, one per model call")
            if self.base_url is not None:
                raise UserError("scripted answers are given by the gateway: leave out base_url")
        if self.temperature is not None and not 0 <= self.temperature <= 2:
            raise UserError(f"temperature {self.temperature} must be in [0, 2]")
        if not self.agent.strip():
            raise UserError("agent is empty: give the command that runs your agent, or module:function")
        if self.base_url is None and (self.api_key_env or self.base_model):
            raise UserError("api_key_env and base_model are for an outside endpoint: give base_url too")
        if self.base_model is not None and self.model_name == "policy":
            self.model_name = self.base_model  # the agents name the model the endpoint serves
        if self.chat_template is not None:
            self.chat_template = Path(self.chat_template)
            if self.base_url is not None:
                raise UserError("chat_template is applied by the gateway that serves model; an outside base_url "
                                "renders prompts its own way: leave it out, or serve the policy here")
            if not self.chat_template.is_file():
                raise UserError(f"chat_template {self.chat_template}: no such file; give a Jinja chat template file")
        self.prompts: PromptPatches | None = None
        if self.prompt is not None:
            self.prompt = Path(self.prompt)
            self.prompts = load_patches(self.prompt)  # a bad file fails here, before anything starts
        if self.tool_format is not None:
            if self.base_url is not None:
                raise UserError("tool_format is applied by the gateway that serves model; an outside base_url "
                                "parses calls its own way: leave it out, or serve the policy here")
            known_tool_format(self.tool_format)
        if self.base_url is not None and self.model is not None:
            raise UserError("give model (served here through the gateway) or base_url (an outside "
                            "OpenAI-compatible server the gateway forwards to, recorded as text), not both")


@dataclass
class Task:
    task_id: str
    line: int
    fields: dict


@dataclass
class RolloutResult:
    rollout_id: str
    task_id: str
    attempt: int
    policy_version: int
    status: str  # ok | failed | timeout | error
    error_class: str | None
    exit_code: int | None
    started_ns: int
    ended_ns: int
    final_output: str | None
    stdout_tail: str
    stderr_tail: str
    command: str
    reward: float | None = None


@dataclass
class RolloutSummary:
    results: list[RolloutResult] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def rewarded(self) -> list[float]:
        return [r.reward for r in self.results if r.reward is not None]


def write_tasks(tasks: list[Task], path: Path) -> Path:
    """Write tasks as a JSONL task file that load_tasks reads back (each row with its id)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({**t.fields, "id": t.task_id}) + "\n" for t in tasks))
    return path


def load_tasks(path: Path) -> list[Task]:
    """Read a JSONL task file; any bad line is an error naming its number."""
    if not path.is_file():
        raise UserError(f"task file {path} does not exist")
    tasks, seen = [], {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise UserError(f"{path}:{number}: a task must be a JSON object, got {type(row).__name__}")
        task_id = str(row["id"]) if row.get("id") not in (None, "") else str(number)
        if task_id in seen:
            raise UserError(f"{path}:{number}: task id {task_id!r} repeats line {seen[task_id]}")
        seen[task_id] = number
        tasks.append(Task(task_id, number, row))
    if not tasks:
        raise UserError(f"task file {path} has no tasks")
    return tasks


def check_inputs(config: RolloutConfig, tasks: list[Task], imported: bool = False) -> list[str] | AgentFunction:
    """Everything that would fail later, found now: the command and every task's placeholders, or the agent
    function (it is imported here, as reward functions are, unless `imported`: a running worker has it)."""
    agent = parse_agent_function(config.agent)
    if agent is not None:
        if not imported:
            load_agent_function(agent)
        for task in tasks:
            check_templates(config.answers or (), task)
        return agent
    argv = shlex.split(config.agent)
    if shutil.which(argv[0]) is None and not Path(argv[0]).exists():
        raise UserError(f"agent command not found: {argv[0]!r}")
    names = {name for token in argv for name in PLACEHOLDER.findall(token)}
    given = set(config.pack.placeholders) if config.pack else set()
    for task in tasks:
        missing = sorted(n for n in names - RUNNER_NAMES - given if n not in task.fields)
        if missing:
            raise UserError(f"{config.tasks}:{task.line}: task {task.task_id!r} has no field(s) {missing} "
                            f"used by --agent; fields: {sorted(task.fields)}{pack_hint(missing)}")
        if names & given and config.pack.check is not None:  # type: ignore[union-attr]
            problem = config.pack.check(task.fields, config.data_dir)  # type: ignore[union-attr]
            if problem:
                raise UserError(f"{config.tasks}:{task.line}: {problem}")
        check_templates(config.answers or (), task)
    return argv


def pack_hint(missing: list[str]) -> str:
    """Which task pack gives a placeholder a task lacks ({db_path}: the spider pack), if one does."""
    for name in pack_names():
        given = [m for m in missing if m in load_pack(name).placeholders]
        if given:
            return (f"; {{{given[0]}}} is given by the {name!r} task pack: choose it with --task-pack {name} "
                    f"(or a reward it registers)")
    return ""


def check_templates(templates, task: Task, what: str = "answer") -> None:
    """Every template formats from the task's fields (else the UserError says which field is missing)."""
    for template in templates:
        format_answer(template, task, what)


def format_answer(template: str, task: Task, what: str = "answer") -> str:
    """`template` filled from the task's fields; `what` names the setting in errors (answer, sft_label)."""
    try:
        return template.format_map(task.fields)
    except KeyError as exc:
        raise UserError(f"{what} {template!r} needs field {exc} which task {task.task_id!r} does not have") from None
    except (ValueError, IndexError) as exc:
        raise UserError(f"{what} {template!r} is not a str.format template ({exc}); write literal braces "
                        "as {{ and }}") from None


def fill_placeholders(argv: list[str], values: dict[str, str]) -> list[str]:
    return [PLACEHOLDER.sub(lambda m: values[m.group(1)], token) for token in argv]


def instrumented(instrument: str, argv: list[str]) -> list[str]:
    """The command under opentelemetry-instrument, once: a command that already starts with it (as the README's
    examples do) runs as given, since a second wrapper would load every instrumentation twice, once in the
    inner wrapper's own Python process (seconds per rollout)."""
    if Path(argv[0]).name == "opentelemetry-instrument":
        return argv
    return [instrument, *argv]


def agent_token(info: CollectorInfo) -> str | None:
    """The token agents get: the collector's ingest token, with a warning when agents could write records
    (their own rewards) with it or without one."""
    admin = info.tokens.get("admin")
    if admin is None or info.ingest_token == admin:
        log.warning("agents can write records such as their own rewards to the collector at %s (%s): start it with "
                    "--ingest-token and --admin-token, or let the runner start its own", info.url,
                    "it needs no admin token" if admin is None else "its one token is also its admin token")
    return info.ingest_token


def find_instrument() -> str:
    """opentelemetry-instrument beside this Python, else on PATH."""
    found = shutil.which("opentelemetry-instrument",
                         path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        raise UserError("opentelemetry-instrument is not installed (pip install opentelemetry-instrumentation)")
    return found


def start_agent_worker(agent: AgentFunction, collector_url: str, collector_token: str | None = None,
                       api_key: str | None = None, model_name: str = "policy",
                       base_url: str | None = None) -> AgentWorker:
    """A started worker process for an agent function, sending its spans to the collector at `collector_url`.
    A caller that runs many rollout calls on one collector (the trainer's rounds) keeps one for all of them
    (run_rollouts(worker=...)); each call's gateway then differs, so give `base_url` only for a worker of one
    call: every rollout gets its own gateway URL as llm.base_url anyway."""
    from lightning_otel.rollouts.inprocess import AgentWorker

    env = agent_environment(base_url or "", collector_url, collector_token, api_key, model_name)
    if base_url is None:
        env.pop("OPENAI_BASE_URL")
        if os.environ.get("OPENAI_BASE_URL"):
            env["OPENAI_BASE_URL"] = os.environ["OPENAI_BASE_URL"]
    argv = [find_instrument(), sys.executable, "-m", "lightning_otel.capture.agent_worker", agent.spec]
    return AgentWorker(agent, argv, env).start()


class Runner:
    def __init__(self, config: RolloutConfig, collector_url: str, collector_token: str | None,
                 write_records: Callable[[str, list[dict]], int], spans_of: Callable[[str], list[dict]],
                 base_url_for: Callable[[str], str], policy_version: int = 0,
                 script: Callable[[str, list[str] | None], None] | None = None,
                 worker: AgentWorker | None = None):
        if config.answers is not None and script is None:
            raise ValueError("scripted answers need a gateway to script (the `script` callback)")
        self.config = config
        self.script = script
        self.base_url_for = base_url_for
        self.policy_version = policy_version
        self.collector_url = collector_url
        self.collector_token = collector_token
        self.write_records = write_records
        self.spans_of = spans_of
        self.worker = worker  # the agent function's worker (in-process mode); run() starts one when None
        self.reward_fn = resolve_reward(config.reward, config.pack) if config.reward else None
        self.instrument = find_instrument()

    def run(self, tasks: list[Task], argv: list[str] | AgentFunction,
            progress: Callable[[RolloutResult, int, int], None] | None = None,
            stop: threading.Event | None = None) -> RolloutSummary:
        """Run every (task, sample); `argv` is the agent command, or function, as check_inputs() returned it.
        Once `stop` is set, the rollouts not yet begun are skipped."""
        if isinstance(argv, AgentFunction) and self.worker is None:
            self.worker = self.start_worker(argv)  # one worker process for every rollout of this call
            try:
                return self._run(tasks, argv, progress, stop)
            finally:
                self.worker.close()
                self.worker = None
        return self._run(tasks, argv, progress, stop)

    def _run(self, tasks: list[Task], argv: list[str] | AgentFunction,
             progress: Callable[[RolloutResult, int, int], None] | None,
             stop: threading.Event | None = None) -> RolloutSummary:
        self.write_records("tasks", [{"task_id": t.task_id, "fields": t.fields, "source": str(self.config.tasks),
                                      "created_ns": time.time_ns()} for t in tasks])
        jobs = [(task, attempt) for task in tasks for attempt in range(self.config.n)]
        summary = RolloutSummary()
        lock = threading.Lock()
        work = self.config.work_dir or Path(tempfile.mkdtemp(prefix="lightning-rollouts-"))
        work.mkdir(parents=True, exist_ok=True)

        def one(job: tuple[Task, int]) -> None:
            if stop is not None and stop.is_set():
                return
            result = self.run_one(argv, job[0], job[1], work)
            with lock:
                summary.results.append(result)
                if progress:
                    progress(result, len(summary.results), len(jobs))

        with ThreadPoolExecutor(self.config.concurrency) as pool:
            list(pool.map(one, jobs))
        if self.config.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
        return summary

    def start_worker(self, agent: AgentFunction) -> AgentWorker:
        """A started worker process for `agent` (UserError when the function does not load there). Its own
        OPENAI_BASE_URL is the gateway without a rollout prefix: a function that ignores llm.base_url still
        reaches the policy (its calls are then recorded under no rollout)."""
        return start_agent_worker(agent, self.collector_url, self.collector_token, self.config.api_key,
                                  self.config.model_name, self.base_url_for(""))

    def run_one(self, argv: list[str] | AgentFunction, task: Task, attempt: int, work: Path) -> RolloutResult:
        rollout_id = new_rollout_id()
        folder = work / rollout_id
        folder.mkdir()
        values = {str(k): str(v) for k, v in task.fields.items()}
        values.update(model=self.config.model_name, rollout_id=rollout_id, attempt=str(attempt), task_id=task.task_id)
        prepared = self.config.pack.setup(task.fields, folder, self.config.data_dir) \
            if self.config.pack and self.config.pack.setup else {}
        values.update(prepared)
        scripted = self.config.answers is not None
        if scripted:
            self.script(rollout_id, [format_answer(a, task) for a in self.config.answers])
        try:
            if isinstance(argv, AgentFunction):
                result = self._call(prepared, rollout_id, task, attempt)
            else:
                result = self._execute(fill_placeholders(argv, values), self._environment(rollout_id, task, attempt),
                                       rollout_id, task, attempt)
        finally:
            if scripted:
                self.script(rollout_id, None)
        self.write_records("rollout_runs", [{k: v for k, v in asdict(result).items() if k != "reward"}])
        if self.reward_fn is not None:
            result.reward = self._score(result, task)
        shutil.rmtree(folder, ignore_errors=True)
        return result

    def _environment(self, rollout_id: str, task: Task, attempt: int) -> dict[str, str]:
        env = agent_environment(self.base_url_for(rollout_id), self.collector_url, self.collector_token,
                                self.config.api_key, self.config.model_name)
        return capture_environment(env, rollout_id=rollout_id, task_id=task.task_id, attempt=attempt)

    def _call(self, prepared: dict[str, str], rollout_id: str, task: Task, attempt: int) -> RolloutResult:
        """One rollout as a call of the agent function in the worker (in-process mode); `task` is the task's
        fields plus what the task pack prepared for this rollout ({db_path})."""
        fields = {**task.fields, **prepared}
        env = self.worker.env  # type: ignore[union-attr]
        llm = {"base_url": self.base_url_for(rollout_id), "api_key": env["OPENAI_API_KEY"],
               "model": self.config.model_name, "rollout_id": rollout_id, "task_id": task.task_id, "attempt": attempt}
        started = time.time_ns()
        reply = self.worker.call({"id": rollout_id, "task": fields, "llm": llm},  # type: ignore[union-attr]
                                 self.config.rollout_timeout_s)
        lines = [line.strip() for line in (reply.get("output") or "").splitlines() if line.strip()]
        return RolloutResult(rollout_id, task.task_id, attempt, self.policy_version, reply["status"],
                             reply.get("error_class"), None, started, time.time_ns(), lines[-1] if lines else None,
                             (reply.get("stdout") or "")[-TAIL_CHARS:], (reply.get("stderr") or "")[-TAIL_CHARS:],
                             self.config.agent)

    def _execute(self, command: list[str], env: dict[str, str], rollout_id: str, task: Task,
                 attempt: int) -> RolloutResult:
        started = time.time_ns()
        status, error_class, exit_code = "ok", None, None
        stdout = stderr = ""
        try:
            proc = subprocess.Popen(instrumented(self.instrument, command), env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True,
                                    preexec_fn=parent_death_signal())
        except OSError as exc:
            status, error_class, stderr = "error", type(exc).__name__, str(exc)
        else:
            try:
                stdout, stderr = proc.communicate(timeout=self.config.rollout_timeout_s)
                exit_code = proc.returncode
                if exit_code != 0:
                    status, error_class = "failed", "NonZeroExit"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                stdout, stderr = proc.communicate()
                status, error_class, exit_code = "timeout", "Timeout", proc.returncode
        lines = [line.strip() for line in stdout.splitlines() if line.strip()]
        return RolloutResult(rollout_id, task.task_id, attempt, self.policy_version, status, error_class,
                             exit_code, started, time.time_ns(), lines[-1] if lines else None,
                             stdout[-TAIL_CHARS:], stderr[-TAIL_CHARS:], shlex.join(command))

    def _score(self, result: RolloutResult, task: Task) -> float | None:
        data_dir = str(self.config.data_dir) if self.config.data_dir else None
        rollout = {**asdict(result), "spans": self.spans_of(result.rollout_id), "data_dir": data_dir}
        try:
            value = call_reward(self.reward_fn, task.fields, rollout)
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - one bad rollout must not stop the batch
            log.warning("reward function failed on rollout %s: %s", result.rollout_id, exc)
            return None
        if value is not None:
            self.write_records("rewards", [{"rollout_id": result.rollout_id, "name": self.config.reward,
                                            "value": value, "source": "function", "created_ns": time.time_ns()}])
        return value


def run_rollouts(config: RolloutConfig, progress: Callable[[RolloutResult, int, int], None] | None = None,
                 engine: PolicyEngine | None = None, worker: AgentWorker | None = None,
                 stop: threading.Event | None = None) -> RolloutSummary:
    """Start what is not running (collector on config.db; engine and gateway unless --base-url points
    elsewhere or an engine is given), run every rollout, stop what was started. Once `stop` is set, the
    rollouts not yet begun are skipped (those running finish): the summary then holds fewer results.

    With an agent function, one worker process serves every rollout of the call; `worker` (one the caller
    started with Runner.start_worker, for the same function and a collector that outlives the calls) is used
    instead and left running."""
    from contextlib import ExitStack

    from lightning_otel.span_store import client, discovery
    from lightning_otel.span_store.collector import Collector, private_config

    tasks = load_tasks(config.tasks)
    argv = check_inputs(config, tasks, imported=worker is not None)  # before anything starts
    if worker is not None and worker.agent.spec != config.agent.strip():
        raise ValueError(f"worker serves {worker.agent.spec!r}, not the config's agent {config.agent!r}")
    with ExitStack() as owned:
        info = discovery.find_collector(config.db)
        if info is None:
            collector = Collector(private_config(config.db))
            collector.start()
            owned.callback(collector.close)
            info = collector.info
        policy_version, script = 0, None
        gateway = start_gateway(config, info, engine, owned)
        policy_version = gateway.engine.policy_version
        base_url_for, script = gateway.base_url, gateway.script

        def spans_of(rollout_id: str) -> list[dict]:
            return client.query(f"SELECT * FROM spans WHERE rollout_id = {client.sql_literal(rollout_id)} "
                                "ORDER BY start_ns", config.db).to_dicts()

        runner = Runner(config, info.url, agent_token(info),
                        lambda table, rows: client.write_records(config.db, table, rows),
                        spans_of, base_url_for, policy_version, script, worker)
        return runner.run(tasks, argv, progress, stop)


def start_gateway(config: RolloutConfig, collector_info, engine, owned):
    """The gateway forwarding to config.base_url (an outside endpoint), or over `engine`, or over a vLLM engine
    started here serving config.model: a policy as eval and serve take it (the bundled model by default, a run
    folder's best checkpoint, a checkpoint, an adapter or a
    model folder: lightning_otel.serve.policy)."""
    from lightning_otel.serve.chat_tools import read_chat_template, template_tools
    from lightning_otel.serve.engine import default_engine_python
    from lightning_otel.serve.gateway import Gateway, GatewayConfig
    from lightning_otel.serve.policy import resolve_policy
    from lightning_otel.serve.serving import engine_for_policy

    common = dict(collector_url=collector_info.url, collector_token=collector_info.ingest_token,
                  max_tokens_cap=config.max_tokens, temperature=config.temperature,
                  max_calls_per_rollout=config.max_calls, prompts=config.prompts)
    if config.base_url is not None:
        if engine is not None:
            raise ValueError("an engine and base_url: the gateway answers with one of them")
        gateway = Gateway(None, GatewayConfig(**common, forward_url=config.base_url,
                                              forward_api_key_env=config.api_key_env, forward_model=config.base_model))
    else:
        if engine is None:
            python = default_engine_python()
            engine = engine_for_policy(resolve_policy(config.model or "base", python), None, owned, python)
        template = read_chat_template(config.chat_template) if config.chat_template is not None else None
        tools = template_tools(engine.config.model_dir, template, config.tool_format)
        gateway = Gateway(engine, GatewayConfig(**common, chat_template=template, native_tools=tools.native,
                                                tool_format=tools.format, adapters=config.adapters), engine.gate)
    gateway.start()
    owned.callback(gateway.close)
    return gateway
