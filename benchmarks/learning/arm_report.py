"""The arithmetic of apo_vs_grpo's report, kept apart from the runs so it can be checked on hand-made folders.

An arm's folder holds `arm.json`: its held-out outcomes (task id -> 1.0 right / 0.0 wrong), the training
rollouts it used, its wall seconds and CPU seconds. `report` compares every arm with base and APO with GRPO
on the same held-out tasks, paired (the exact sign test on the tasks whose outcome differs: McNemar's exact
test with one greedy sample a task), and states whether the goal holds: APO's held-out gain over base at
least half GRPO's, with at most a tenth of GRPO's training rollouts.
"""
from __future__ import annotations

import json
from pathlib import Path

from lightning_otel.eval.metrics import sign_test_p

ARMS = ("base", "apo", "grpo", "apo_grpo")


def paired(after: dict[str, float], before: dict[str, float]) -> dict:
    """`after` against `before` on the tasks both scored: gained, lost, the exact two-sided p."""
    shared = sorted(set(after) & set(before))
    gained = sum(1 for t in shared if after[t] > before[t])
    lost = sum(1 for t in shared if after[t] < before[t])
    return {"tasks": len(shared), "gained": gained, "lost": lost, "p": sign_test_p(gained, lost)}


def goal(apo_gain: float, grpo_gain: float, apo_rollouts: int, grpo_rollouts: int) -> dict:
    """The issue's goal: APO gains at least half of GRPO's held-out gain, with at most a tenth of its rollouts."""
    half = grpo_gain > 0 and apo_gain >= grpo_gain / 2
    tenth = grpo_rollouts > 0 and apo_rollouts * 10 <= grpo_rollouts
    return {"half_the_gain": half, "a_tenth_of_the_rollouts": tenth, "holds": half and tenth,
            "apo_share_of_gain": apo_gain / grpo_gain if grpo_gain > 0 else None,
            "apo_share_of_rollouts": apo_rollouts / grpo_rollouts if grpo_rollouts > 0 else None}


def read_arm(folder: Path) -> dict | None:
    path = folder / "arm.json"
    return json.loads(path.read_text()) if path.is_file() else None


def report(arms: dict[str, dict], held_out: list[str]) -> dict:
    """Per arm: accuracy on `held_out`, gain over base (paired), rollouts, CPU; APO against GRPO; the goal.
    An arm may lack per-task outcomes (a recorded run whose store is gone): then it has `right` and no test."""
    rows: dict[str, dict] = {}
    base = arms.get("base")
    for name in ARMS:
        arm = arms.get(name)
        if arm is None:
            continue
        outcomes = arm.get("outcomes")
        if outcomes is not None:
            missing = sorted(set(held_out) - set(outcomes))
            if missing:
                raise ValueError(f"arm {name}: no held-out outcome for {len(missing)} task(s), e.g. {missing[:3]}")
            right = sum(outcomes[t] for t in held_out)
        else:
            right = arm["right"]
        row = {"right": right, "tasks": len(held_out), "accuracy": right / len(held_out),
               "rollouts": arm["rollouts"], "cpu_seconds": arm.get("cpu_seconds"),
               "wall_seconds": arm.get("wall_seconds"), "source": arm.get("source", "run here")}
        if base is not None and name != "base":
            base_right = arm["base_right"] if "base_right" in arm else (  # a recorded run's own base
                sum(base["outcomes"][t] for t in held_out) if base.get("outcomes") else base["right"])
            row["gain"] = (right - base_right) / len(held_out)
            if outcomes is not None and base.get("outcomes") is not None:
                row["vs_base"] = paired(outcomes, base["outcomes"])
        rows[name] = row
    result: dict = {"arms": rows}
    apo, grpo = arms.get("apo"), arms.get("grpo")
    if apo is not None and grpo is not None:
        if apo.get("outcomes") is not None and grpo.get("outcomes") is not None:
            result["apo_vs_grpo"] = paired(apo["outcomes"], grpo["outcomes"])
        if "gain" in rows["apo"] and "gain" in rows["grpo"]:
            result["goal"] = goal(rows["apo"]["gain"], rows["grpo"]["gain"], rows["apo"]["rollouts"],
                                  rows["grpo"]["rollouts"])
    return result


def table(result: dict) -> str:
    """The report as a Markdown table."""
    lines = ["| arm | held-out right | accuracy | gain vs base (paired) | training rollouts | CPU min | wall min |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: |"]
    for name, row in result["arms"].items():
        versus = row.get("vs_base")
        gain = "" if "gain" not in row else f"{row['gain'] * 100:+.1f} pts" + (
            f" (+{versus['gained']} / -{versus['lost']}, p = {versus['p']:.2g})" if versus else " (unpaired)")
        minutes = [f"{row[k] / 60:.1f}" if row.get(k) is not None else "-" for k in ("cpu_seconds", "wall_seconds")]
        lines.append(f"| {name} | {row['right']:g}/{row['tasks']} | {row['accuracy']:.1%} | {gain} | "
                     f"{row['rollouts']} | {minutes[0]} | {minutes[1]} |")
    return "\n".join(lines)


__all__ = ["ARMS", "paired", "goal", "read_arm", "report", "table"]
