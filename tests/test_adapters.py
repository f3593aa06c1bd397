"""One LoRA adapter per agent (`adapters = {name: agent-pattern}`): the config, its checks and the routing rule."""
from __future__ import annotations

import tomllib

import pytest

from lightning_otel.errors import UserError
from lightning_otel.serve.adapters import adapter_for, adapter_of_agent, check_adapters
from lightning_otel.train.config import load_config
from lightning_otel.train.settings import render_toml

PAIR = {"writer": "generate_query", "checker": "check_query"}


def test_adapters_from_toml_and_key_value_and_back(tmp_path):
    toml = tmp_path / "train.toml"
    toml.write_text('adapters = {writer = "generate_query", checker = "check_query"}\n')
    assert load_config(toml).adapters == PAIR
    assert load_config(None, ["adapters=writer:generate_query, checker:check_query"]).adapters == PAIR
    assert load_config(None, ['adapters={"w": "a|b:c"}']).adapters == {"w": "a|b:c"}
    saved = render_toml(load_config(toml))
    assert tomllib.loads(saved)["adapters"] == PAIR  # the saved run config reads back (resume compares it)
    assert list(tomllib.loads(saved)["adapters"]) == ["writer", "checker"]  # order kept: the first match wins
    assert load_config().adapters == {}


@pytest.mark.parametrize("override, says", [
    ("adapters=../up:x", "cannot be a folder name"),
    ("adapters=a/b:x", "cannot be a folder name"),
    ("adapters=.hidden:x", "cannot be a folder name"),
    ("adapters=Writer:x,writer:y", "differ only in case"),
    ("adapters=writer:x,writer:y", "each name once"),
    ("adapters=base:x", "reserved"),
    ("adapters=writer:", "give a regular expression"),
    ("adapters=writer:(unclosed", "not a regular expression"),
    ("adapters=writer", "name:pattern pairs"),
    ('adapters={"writer": 3}', "object of texts"),
    ("adapters=writer:x full_finetune=true", "full_finetune"),
    ("adapters=writer:x serve_merged=true", "serve_merged"),
])
def test_bad_adapters_are_refused_with_what_to_do(override, says):
    with pytest.raises(UserError, match=says):
        load_config(None, override.split(" ", 1) if "full" in override or "merged" in override else [override])


def test_routing_rule_matches_whole_agent_names_first_pattern_first():
    adapters = check_adapters({"writer": "generate_query|rewrite", "any": ".*_query"})
    assert adapter_of_agent(adapters, "generate_query") == "writer"
    assert adapter_of_agent(adapters, "check_query") == "any"
    assert adapter_of_agent(adapters, "generate_query_2") is None  # whole names, as compile --agents matches
    assert adapter_of_agent(adapters, "rewrite") == "writer"
    assert adapter_of_agent(adapters, None) is None
    assert adapter_for(adapters, "any", "generate_query") == "any"  # the request's model names an adapter
    assert adapter_for(adapters, "gpt-4o", "list_tables") is None  # no adapter: the base model
    with pytest.raises(UserError, match="table of adapter names"):
        check_adapters(["writer"])
