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


def test_rollout_takes_the_sampling_settings_and_refuses_them_for_an_outside_endpoint(tmp_path):
    from lightning_otel.cli.rollouts import cmd_rollout
    from lightning_otel.rollouts.runner import RolloutConfig

    parser = build_parser()
    args = parser.parse_args(["rollout", "--tasks", "t.jsonl", "--agent", "a", "--max-tokens", "64",
                              "--temperature", "0.7"])
    assert (args.max_tokens, args.temperature) == (64, 0.7)
    defaults = parser.parse_args(["rollout", "--tasks", "t.jsonl", "--agent", "a"])
    assert (defaults.max_tokens, defaults.temperature) == (None, None)
    with pytest.raises(UserError, match="applied by the gateway"):
        RolloutConfig(tasks=tmp_path / "t.jsonl", agent="a", base_url="http://127.0.0.1:9/v1", temperature=0.7)
    outside = parser.parse_args(["rollout", "--tasks", str(tmp_path / "t.jsonl"), "--agent", "a", "--base-url",
                                 "http://127.0.0.1:9/v1", "--max-tokens", "64"])
    with pytest.raises(UserError, match="max_tokens and temperature"):
        cmd_rollout(outside)


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
