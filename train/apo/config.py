"""The prompt optimiser's configuration: one dataclass, from a TOML file and `key=value` arguments, the way
`train` takes its settings (train/settings.py).

    lightning-otel optimize --config optimize.toml max_metric_calls=60 proposer=demos

The resolved config is printed at start and saved as `<output_dir>/config.toml`; a rerun of the same command
continues the run in `output_dir` (only RESUMABLE_CHANGES may differ).
"""
from __future__ import annotations

import dataclasses
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_otel.errors import UserError
from lightning_otel.serve.toolcalls import FORMATS
from lightning_otel.train.settings import load_settings, render_toml

PROPOSERS = ("reflection", "demos", "both")
LABEL = "optimize config"
# Keys that may differ when a run is resumed: they change how long or how fast it runs, not what it measures.
RESUMABLE_CHANGES = {"max_metric_calls", "demos_sets", "concurrency", "rollout_timeout_s", "engine_python",
                     "engine_url", "reflection_url", "reflection_model", "reflection_api_key_env",
                     "reflection_max_tokens"}


@dataclass
class OptimizeConfig:
    # the agent, its tasks and how they are scored (as in `train` and `rollout`)
    tasks: str = ""                   # JSONL task file: the train split (the reflection and the demonstrations
                                      # learn from it)
    val_tasks: str = ""               # JSONL task file: the validation split candidates are compared on (empty:
                                      # val_fraction of `tasks`, drawn with `seed`)
    val_fraction: float = 0.5
    agent: str = ""                   # the agent command or module:function, unchanged (see `lightning-otel rollout`)
    reward: str = ""                  # reward function: a name a task pack registers, or module:function
    task_pack: str = ""               # task pack (default: the one that registers `reward`)
    data_dir: str = ""                # the task pack's data folder (default: the pack's own)
    agents: str = ""                  # regex over whole agent names: optimise only their system messages ("" =
                                      # every system message the seed rollouts sent)
    # the policy that runs the agent
    model: str = "bundled"            # "bundled" or a local Hugging Face model folder
    engine_python: str = ""           # the Python that starts vLLM (default: .venv-engine, else this one)
    engine_url: str = ""              # a vLLM server already running on this machine, instead of starting one
    chat_template: str = ""           # a Jinja chat template file the gateway renders prompts with
    tool_format: str = ""             # the call syntax (hermes, llama3_json, ...; empty: detected)
    # or a closed model: an outside OpenAI-compatible endpoint the gateway forwards every call to (the patch
    # applied, recorded as text; no engine starts)
    base_url: str = ""                # e.g. https://api.openai.com/v1 (empty: serve `model` here)
    base_model: str = ""              # the model name every call is sent with, and the agents' {model}
    api_key_env: str = ""             # the environment variable with its key (empty: the agents' own key goes through)
    output_dir: str = "runs/optimize"
    # how a candidate is evaluated: n rollouts of every task of a split, scored by the mean reward
    n: int = 1                        # samples per task (mean reward; a rollout without a reward counts 0)
    temperature: float = 0.0          # forced on every call (0: greedy, so a candidate's score does not drift)
    max_tokens: int = 256             # cap on each generation
    concurrency: int = 2              # agents running at once
    rollout_timeout_s: float = 300.0
    # the search
    proposer: str = "both"            # reflection (GEPA), demos (bootstrapped demonstrations) or both (reflection
                                      # first, then demonstrations on the best instruction)
    max_metric_calls: int = 40        # GEPA's budget: task evaluations (one per task per candidate evaluated)
    minibatch: int = 3                # train tasks per reflection step
    seed: int = 0
    # the reflection model: any OpenAI-compatible endpoint (empty: the served policy itself)
    reflection_url: str = ""          # e.g. https://api.openai.com/v1
    reflection_model: str = ""        # e.g. gpt-4.1 (empty with reflection_url: the server's first model)
    reflection_api_key_env: str = "OPENAI_API_KEY"  # the environment variable that holds its key
    reflection_max_tokens: int = 512
    reflection_temperature: float = 0.7
    # the demonstrations proposer
    demos_k: int = 2                  # demonstrations per set
    demos_sets: int = 4               # sets tried on the validation split
    demos_min_reward: float = 1.0     # a call is a demonstration when its rollout earned at least this
    demos_tool_calls: str = ""        # a tool syntax (hermes, llama3_json, ...): calls answered with a tool call
                                      # become demonstrations too, the call written in it (empty: text answers only)

    def __post_init__(self) -> None:
        checks = [
            (bool(self.tasks.strip()), "tasks is empty: give a JSONL task file (one task per line)"),
            (bool(self.agent.strip()), "agent is empty: give the command that runs your agent, or module:function"),
            (bool(self.reward.strip()), "reward is not set: candidates are compared by the task pack's reward; set "
                                        "reward to a registered name (spider_exec, number_match) or module:function"),
            (0 < self.val_fraction < 1, f"val_fraction = {self.val_fraction}: the share of tasks held out for "
                                        f"validation is between 0 and 1 (or give val_tasks)"),
            (self.proposer in PROPOSERS, f"proposer = {self.proposer!r}: choose one of {', '.join(PROPOSERS)}"),
            (self.n >= 1, f"n = {self.n}: samples per task must be at least 1"),
            (0 <= self.temperature <= 2, f"temperature = {self.temperature}: choose 0 (greedy) to 2"),
            (self.max_tokens >= 1, "max_tokens must be at least 1"),
            (self.concurrency >= 1, "concurrency must be at least 1"),
            (self.rollout_timeout_s > 0, "rollout_timeout_s must be > 0"),
            (self.max_metric_calls >= 1, "max_metric_calls must be at least 1 (task evaluations GEPA may spend)"),
            (self.minibatch >= 1, "minibatch must be at least 1 (train tasks per reflection step)"),
            (self.reflection_max_tokens >= 16, "reflection_max_tokens must be at least 16"),
            (0 <= self.reflection_temperature <= 2, "reflection_temperature must be in [0, 2]"),
            (self.demos_k >= 1 and self.demos_sets >= 1, "demos_k and demos_sets must be at least 1"),
            (not self.reflection_model or self.reflection_url,
             f"reflection_model = {self.reflection_model!r} needs reflection_url (the endpoint that serves it); "
             f"without reflection_url the served policy reflects"),
            (not self.demos_tool_calls or self.demos_tool_calls in FORMATS,
             f"demos_tool_calls = {self.demos_tool_calls!r}: choose one of {', '.join(FORMATS)} (the syntax the "
             f"model is shown past calls in; hermes for the bundled model), or leave it empty"),
            (not self.tool_format or self.tool_format in FORMATS,
             f"tool_format = {self.tool_format!r}: choose one of {', '.join(FORMATS)}"),
            (not self.base_url or self.base_url.startswith(("http://", "https://")),
             f"base_url = {self.base_url!r}: give the outside endpoint's base URL, like https://api.openai.com/v1"),
            (not self.base_url or not (self.engine_url or self.chat_template or self.tool_format
                                       or self.model != "bundled"),
             "base_url runs the agent on an outside endpoint: model, engine_url, chat_template and tool_format are for "
             "a policy served here; leave them out"),
            (self.base_url or not (self.base_model or self.api_key_env),
             "base_model and api_key_env are for an outside endpoint: give base_url too"),
            (not self.chat_template or Path(self.chat_template).expanduser().is_file(),
             f"chat_template = {self.chat_template}: no such file"),
        ]
        for ok, message in checks:
            if not ok:
                raise UserError(f"{LABEL}: {message}")
        try:
            re.compile(self.agents)
        except re.error as exc:
            raise UserError(f"{LABEL}: agents = {self.agents!r} is not a regular expression ({exc})") from None
        for key in ("tasks", "val_tasks"):
            value = getattr(self, key)
            if value and not Path(value).expanduser().is_file():
                raise UserError(f"{LABEL}: {key} = {value}: no such file; give a JSONL task file")

    @property
    def uses_reflection(self) -> bool:
        return self.proposer in ("reflection", "both")

    @property
    def uses_demos(self) -> bool:
        return self.proposer in ("demos", "both")

    def save(self, path: Path) -> None:
        path.write_text(render_toml(self))


def load_optimize_config(path: Path | None = None, overrides: list[str] = (), **values: Any) -> OptimizeConfig:
    """Defaults, then the TOML file, then `key=value` overrides, then keyword values (CLI flags)."""
    return load_settings(OptimizeConfig, LABEL, path, overrides, **values)


def check_resume(config: OptimizeConfig, folder: Path) -> bool:
    """Whether `folder` holds a run to continue, after checking it was started with the same settings (but for
    RESUMABLE_CHANGES); False for a new run."""
    saved_file = folder / "config.toml"
    if not saved_file.is_file():
        return False
    saved = tomllib.loads(saved_file.read_text())
    changed = sorted(f.name for f in dataclasses.fields(config)
                     if f.name in saved and saved[f.name] != getattr(config, f.name)
                     and f.name not in RESUMABLE_CHANGES)
    if changed:
        raise UserError(f"{folder} holds an optimisation run with different settings ({', '.join(changed)}): "
                        f"continue it with the same config (only {', '.join(sorted(RESUMABLE_CHANGES))} may change), "
                        f"or give a new output_dir")
    return True


__all__ = ["OptimizeConfig", "load_optimize_config", "check_resume", "PROPOSERS"]
