"""The Spider task pack: text-to-SQL questions on SQLite databases in Spider's layout
(<data_dir>/database/<db_id>/<db_id>.sqlite; a subset ships in data/, see its README for source and licence).

- rewards: `spider_exec` (execution match against the gold query) and `spider_shaped` (with partial credit);
- setup: each rollout gets a fresh copy of its task's database as {db_path}, so model-written SQL cannot
  damage shared files;
- outcome classes for reports: wrong_result, sql_error, no_sql; accuracy by the task's `hardness`;
- training data from the databases themselves: templated questions (synthesis), questions asked again on
  renamed copies (renaming), repair paths for a reviewing agent (repair), schema-linked SFT labels (linking),
  and a split that keeps whole databases out of training (splits).
"""
from __future__ import annotations

import shutil
from pathlib import Path

from lightning_otel.rollouts.packs import TaskPack
from lightning_otel.tasks.spider.outcomes import HARDNESS_ORDER, OUTCOME_CLASSES, classify
from lightning_otel.tasks.spider.rewards import bundled_data_dir, database_path, spider_exec, spider_shaped


def check_task(task: dict, data_dir: Path | None) -> str | None:
    """What keeps a task from running: no db_id, or no database file for it."""
    db_id = task.get("db_id")
    if not db_id:
        return "{db_path} needs a db_id field"
    source = database_path(data_dir or bundled_data_dir(), str(db_id))
    return None if source.is_file() else f"database {source} does not exist; check --data-dir"


def copy_database(task: dict, folder: Path, data_dir: Path | None) -> dict[str, str]:
    """{db_path}: the rollout's own copy of its task's database."""
    if "db_id" not in task:
        return {}
    source = database_path(data_dir or bundled_data_dir(), str(task["db_id"]))
    return {"db_path": str(shutil.copy(source, folder / source.name))} if source.is_file() else {}


PACK = TaskPack(name="spider", rewards={"spider_exec": spider_exec, "spider_shaped": spider_shaped},
                classify=classify, outcome_classes=OUTCOME_CLASSES, setup=copy_database, placeholders=("db_path",),
                check=check_task, data_dir=bundled_data_dir, group_field="hardness", group_order=HARDNESS_ORDER)
