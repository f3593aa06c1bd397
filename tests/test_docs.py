"""The README and docs/ stay true to the code: the config table is the dataclass's, links resolve, the README
stays a front door, and every command it names exists."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
START, END = "<!-- config-table:start -->", "<!-- config-table:end -->"
# [text](target) and [text](target "title"); images too. Reference-style definitions: [label]: target
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1", re.DOTALL)


def config_docs():
    """This checkout's train/config_docs.py (the installed lightning_otel.train may be another checkout's)."""
    spec = importlib.util.spec_from_file_location("_config_docs_under_test", ROOT / "train" / "config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def prose(text: str) -> str:
    """Markdown without fenced blocks and code spans: what links can be in."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def relative_links(text: str) -> list[str]:
    found = INLINE_LINK.findall(prose(text)) + REFERENCE_LINK.findall(prose(text))
    return [t for t in found if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", t) and not t.startswith(("#", "//"))]


def test_config_table_in_training_md_is_generated_from_train_config():
    page = (ROOT / "docs" / "training.md").read_text()
    assert page.count(START) == 1 and page.count(END) == 1, f"docs/training.md needs one {START} and one {END}"
    table = page.split(START, 1)[1].split(END, 1)[0]
    assert table.strip() == config_docs().config_reference_markdown().strip(), (
        "docs/training.md's config table is out of date with TrainConfig: run "
        "`python -m lightning_otel.train.config_docs --write docs/training.md`")


def test_every_train_config_key_has_a_meaning():
    import dataclasses

    from lightning_otel.train.config import TrainConfig

    module = config_docs()
    assert set(module.HELP) == {f.name for f in dataclasses.fields(TrainConfig)}


def test_readme_is_a_front_door_of_at_most_200_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files_that_exist(page: Path):
    broken = []
    for target in relative_links(page.read_text()):
        path = target.split("#", 1)[0].split("?", 1)[0]
        if path and not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files: {broken}"


def test_the_link_finder_sees_links_and_skips_code():
    text = ('See [a](docs/a.md), [b](../b.md#part "title"), ![c](fig.png), [web](https://x.org), [top](#x).\n'
            '[ref]: docs/ref.md\n`[not](code.md)`\n```\n[not](fenced.md)\n```\n')
    assert relative_links(text) == ["docs/a.md", "../b.md#part", "fig.png", "docs/ref.md"]


def test_every_command_the_readme_names_exists():
    import argparse

    from lightning_otel.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    named = set(re.findall(r"(?<![\w.-])lightning-otel ([a-z][a-z0-9-]*)", README.read_text()))
    assert named, "the README names no lightning-otel command"
    unknown = sorted(named - set(commands))
    assert not unknown, f"README.md names commands that do not exist: {unknown}; known: {sorted(commands)}"
