"""Options mean the same in every command: -n is samples per task with one default, the per-rollout time limit
has one name; the previous release's spellings still parse, with a note."""
from __future__ import annotations

import pytest

from lightning_otel.cli import build_parser
from lightning_otel.cli.options import SAMPLES
from lightning_otel.errors import UserError

COMMANDS = {"rollout": ["--tasks", "t.jsonl", "--agent", "python a.py"],
            "eval": ["--tasks", "t.jsonl", "--agent", "python a.py", "--report", "r", "--reward", "spider_exec"]}


@pytest.mark.parametrize("command", COMMANDS)
def test_samples_and_the_rollout_time_limit_mean_the_same_everywhere(command, capsys):
    parser = build_parser()
    args = parser.parse_args([command, *COMMANDS[command]])
    assert args.n == SAMPLES == 4 and args.rollout_timeout == 300.0
    assert parser.parse_args([command, *COMMANDS[command], "--rollout-timeout", "7"]).rollout_timeout == 7.0
    assert capsys.readouterr().err == ""
    old = parser.parse_args([command, *COMMANDS[command], "--timeout", "5"])
    assert old.rollout_timeout == 5.0 and "--timeout is now --rollout-timeout" in capsys.readouterr().err


def test_compile_names_its_tokenizer_and_lists_the_advantages(capsys):
    parser = build_parser()
    assert parser.parse_args(["compile", "--out", "o.parquet", "--tokenizer", "none"]).tokenizer == "none"
    old = parser.parse_args(["compile", "--out", "o.parquet", "--model", "none"])
    assert old.tokenizer == "none" and "--model is now --tokenizer" in capsys.readouterr().err
    for name in ("per-rollout", "per-transition", "batch-baseline", "reinforce-pp", "none", "reinforce_pp"):
        assert parser.parse_args(["compile", "--out", "o.parquet", "--advantage", name]).advantage == name
    with pytest.raises(SystemExit):
        parser.parse_args(["compile", "--out", "o.parquet", "--advantage", "reinforce++"])
    assert "invalid choice" in capsys.readouterr().err


def test_rollout_takes_the_sampling_settings_also_for_an_outside_endpoint(tmp_path):
    from lightning_otel.rollouts.runner import RolloutConfig

    parser = build_parser()
    args = parser.parse_args(["rollout", "--tasks", "t.jsonl", "--agent", "a", "--max-tokens", "64",
                              "--temperature", "0.7"])
    assert (args.max_tokens, args.temperature) == (64, 0.7)
    defaults = parser.parse_args(["rollout", "--tasks", "t.jsonl", "--agent", "a"])
    assert (defaults.max_tokens, defaults.temperature) == (None, None)
    # An outside endpoint gets them too: the gateway that forwards to it sets them as request parameters.
    outside = RolloutConfig(tasks=tmp_path / "t.jsonl", agent="a", base_url="http://127.0.0.1:9/v1", temperature=0.7,
                            max_tokens=64, base_model="gpt-x")
    assert (outside.temperature, outside.max_tokens, outside.model_name) == (0.7, 64, "gpt-x")
    with pytest.raises(UserError, match="give base_url too"):
        RolloutConfig(tasks=tmp_path / "t.jsonl", agent="a", api_key_env="OPENAI_API_KEY")


def test_the_chat_template_option_is_one_file_everywhere(tmp_path):
    from pathlib import Path

    from lightning_otel.rollouts.runner import RolloutConfig
    from lightning_otel.train.config import TrainConfig

    parser = build_parser()
    for command, rest in [*COMMANDS.items(), ("serve", ["base"]), ("compile", ["--out", "o.parquet"])]:
        assert parser.parse_args([command, *rest, "--chat-template", "t.jinja"]).chat_template == Path("t.jinja")
        assert parser.parse_args([command, *rest]).chat_template is None
    template = tmp_path / "t.jinja"
    with pytest.raises(UserError, match="no such file"):
        RolloutConfig(tasks=tmp_path / "t.jsonl", agent="a", chat_template=template)
    with pytest.raises(UserError, match="no such file"):
        TrainConfig(chat_template=str(template))
    template.write_text("{{ messages }}")
    with pytest.raises(UserError, match="applied by the gateway"):
        RolloutConfig(tasks=tmp_path / "t.jsonl", agent="a", chat_template=template, base_url="http://127.0.0.1:9/v1")
    assert RolloutConfig(tasks=tmp_path / "t.jsonl", agent="a", chat_template=str(template)).chat_template == template


def test_the_tool_format_option_names_a_known_format_everywhere(tmp_path, monkeypatch, capsys):
    from lightning_otel.eval import EvalConfig
    from lightning_otel.rollouts.runner import RolloutConfig
    from lightning_otel.serve import serving
    from lightning_otel.train.config import TrainConfig
    from lightning_otel.train.transitions.compile import CompileConfig

    parser = build_parser()
    for command, rest in [*COMMANDS.items(), ("serve", ["base"]), ("compile", ["--out", "o.parquet"])]:
        assert parser.parse_args([command, *rest, "--tool-format", "llama3_json"]).tool_format == "llama3_json"
        assert parser.parse_args([command, *rest]).tool_format is None  # detected from the chat template
        with pytest.raises(SystemExit):
            parser.parse_args([command, *rest, "--tool-format", "llama3"])
        err = capsys.readouterr().err
        assert "--tool-format: invalid choice: 'llama3'" in err and "mistral_v11" in err
    tasks = tmp_path / "t.jsonl"
    tasks.write_text('{"id": "1"}\n')
    known = "choose one of hermes, llama3_json, mistral, mistral_v11"
    for make in (lambda f: RolloutConfig(tasks=tasks, agent="a", tool_format=f),
                 lambda f: EvalConfig(tasks=tasks, agent="a", report=tmp_path / "r", reward="number_match",
                                      tool_format=f),
                 lambda f: CompileConfig(db=tmp_path / "db", tool_format=f),
                 lambda f: TrainConfig(tool_format=f)):
        assert make("mistral").tool_format == "mistral"
        with pytest.raises(UserError, match=known):
            make("Mistral")
    assert TrainConfig().tool_format == "" and RolloutConfig(tasks=tasks, agent="a").tool_format is None
    with pytest.raises(UserError, match="tool_format is applied by the gateway"):
        RolloutConfig(tasks=tasks, agent="a", tool_format="hermes", base_url="http://127.0.0.1:9/v1")
    # The commands hand the option on.
    seen = {}

    def stop_at(what: str):
        def record(*args, **kwargs):
            seen[what] = (args, kwargs)
            raise KeyError(what)
        return record

    monkeypatch.setattr("lightning_otel.rollouts.runner.run_rollouts", stop_at("rollout"))
    monkeypatch.setattr(serving, "serve_policy", stop_at("serve"))
    monkeypatch.setattr("lightning_otel.eval.evaluate", stop_at("eval"))
    monkeypatch.setattr("lightning_otel.train.transitions.compile.compile_transitions", stop_at("compile"))
    for argv in (["rollout", "--tasks", str(tasks), "--agent", "a", "--tool-format", "mistral"],
                 ["serve", "base", "--tool-format", "mistral_v11"],
                 ["eval", "--tasks", str(tasks), "--agent", "a", "--report", str(tmp_path / "r"), "--reward",
                  "number_match", "--tool-format", "llama3_json"],
                 ["compile", "--out", "o.parquet", "--tool-format", "hermes"]):
        args = parser.parse_args(argv)
        with pytest.raises(KeyError):
            args.func(args)
    assert seen["rollout"][0][0].tool_format == "mistral" and seen["serve"][1]["tool_format"] == "mistral_v11"
    assert seen["eval"][0][0].tool_format == "llama3_json" and seen["compile"][0][0].tool_format == "hermes"


def test_the_rollout_gateway_takes_the_format_named_else_the_models_templates(tmp_path):
    import json
    from contextlib import ExitStack
    from types import SimpleNamespace

    from conftest import FIXTURES
    from lightning_otel.rollouts.runner import RolloutConfig, start_gateway
    from lightning_otel.serve.gate import SwapGate

    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": (FIXTURES / "llama3_tools.jinja").read_text()}))
    engine = SimpleNamespace(config=SimpleNamespace(model_dir=model), gate=SwapGate())
    collector = SimpleNamespace(url=None, ingest_token=None)
    (tmp_path / "t.jsonl").write_text('{"id": "1"}\n')
    for named, expected in ((None, "llama3_json"), ("mistral", "mistral")):
        with ExitStack() as owned:
            config = RolloutConfig(tasks=tmp_path / "t.jsonl", agent="a", tool_format=named)
            gateway = start_gateway(config, collector, engine, owned)
            assert (gateway.config.tool_format, gateway.config.native_tools) == (expected, True)
