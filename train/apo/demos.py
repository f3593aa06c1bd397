"""The demonstrations proposer: few-shot examples bootstrapped from the agent's own high-reward calls; it needs no
strong model.

1. The starting candidate (the seed, or the reflection's best) runs on every train task (read back where it did).
2. The pool, per component: the calls of train-split rollouts (of any candidate so far) that earned at least
   `demos_min_reward`, that sent the component's system message, opened their conversation (one user message
   after the system message) and answered in text, or (with `demos_tool_calls`, a tool syntax) with tool calls,
   written as that syntax's text, unless a later call of the same rollout and component answered that answer
   back as the user (the agent's code asked for a correction: the reward was earned by a later answer, not by
   this one; a tool result is not such an answer). Each gives a pair (user message, answer) with its episode
   reward; one per user text, the best rewarded.
3. Up to `demos_sets` different sets of `demos_k` pairs, drawn with `seed` from the best rewarded pairs first (a
   pair of lower reward enters only when the better ones cannot make a new set: with a shaped reward, a partly
   right answer is shown only where too few right ones exist), each added as `demos` to one component of the
   starting candidate, are evaluated on the validation split like every candidate; the best set is kept when it
   beats the starting candidate there.

Only train-split calls become demonstrations, so no validation task's answer is shown to the model it is scored
on. The pool and each set's score are kept in `demos.json` in the run folder: a rerun reads the pool back (the
same sets are drawn) and evaluates only the sets it has no score for.
"""
from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from lightning_otel.rollouts.runner import Task
from lightning_otel.serve.toolcalls import ToolFormat
from lightning_otel.train.apo.adapter import answer_text, conversation, message_text, stored_messages
from lightning_otel.train.apo.candidates import Component, component_of, with_demos
from lightning_otel.train.apo.evaluation import Evaluator
from lightning_otel.train.transitions.retokenize import assistant_message

log = logging.getLogger(__name__)


@dataclass
class DemosOutcome:
    candidate: dict[str, str]   # the best: the starting candidate, or it with the best set of demonstrations
    score: float | None         # its validation score
    start_score: float | None   # the starting candidate's
    tried: int                  # sets evaluated (now or before a resume)
    pool: dict[str, int]        # demonstrations available per component


def demo_pair(call: dict, syntax: ToolFormat | None = None, opening: list[dict] | None = None) -> dict | None:
    """(user, assistant) of a call that opened its conversation with one user message and answered in text, or
    with tool calls when `syntax` is given (the answer is then its text and the calls in that syntax). `opening`:
    the call's conversation after its system message, where the caller has it already."""
    opening = conversation(call["input_messages"]) if opening is None else opening
    if len(opening) != 1 or opening[0].get("role") != "user":
        return None
    answers = stored_messages(call["output_messages"])
    called = any(isinstance(p, dict) and p.get("type") == "tool_call" for m in answers for p in (m.get("parts") or []))
    user = message_text(opening[0]).strip()
    if called:
        if syntax is None:
            return None
        message, _ = assistant_message(call["output_messages"])  # OpenAI-shaped, as the retokenizer renders it
        assistant = syntax.render_messages([message], None)[0]["content"].strip()
    else:
        assistant = answer_text(call["output_messages"]).strip()
    return {"user": user, "assistant": assistant} if user and assistant else None


def demo_pool(calls: list[dict], rewards: dict[str, float | None], components: list[Component],
              min_reward: float, syntax: ToolFormat | None = None) -> dict[str, list[dict]]:
    """Per component, the demonstrations the high-reward calls give (module docstring, step 2); `calls` in order
    (read_calls), `rewards` by rollout id."""
    pool: dict[str, list[dict]] = {c.name: [] for c in components}
    seen: dict[tuple[str, str], dict] = {}
    # each call's component and conversation, read once: the corrections and the pairs both need them
    named = [(call, getattr(component_of(components, call["system"]), "name", None),
              conversation(call["input_messages"])) for call in calls if call["system"] is not None]
    corrected = _answered_back(named)
    for call, name, opening in named:
        reward = rewards.get(call["rollout_id"])
        if reward is None or reward < min_reward or name is None:
            continue
        pair = demo_pair(call, syntax, opening)
        if pair is None or (call["rollout_id"], name, pair["user"]) in corrected:
            continue
        pair["reward"] = float(reward)
        earlier = seen.get((name, pair["user"]))
        if earlier is None:
            seen[(name, pair["user"])] = pair
            pool[name].append(pair)
        elif pair["reward"] > earlier["reward"]:  # the same question answered better: that answer, in its place
            earlier.update(pair)
    return pool


def _answered_back(named: list[tuple[dict, str | None, list[dict]]]) -> set[tuple[str, str, str]]:
    """(rollout id, component, opening user text) of the conversations whose later calls carry a user message
    after the opening one: the agent's code answered the model back (e.g. with an error to correct). `named`:
    (call, its component's name or None, its conversation after the system message)."""
    return {(call["rollout_id"], name, message_text(opening[0]).strip()) for call, name, opening in named
            if name and len(opening) > 1 and opening[0].get("role") == "user"
            and any(m.get("role") == "user" for m in opening[1:])}


def demo_sets(pool: dict[str, list[dict]], k: int, count: int, seed: int) -> list[tuple[str, list[dict]]]:
    """Up to `count` different (component, demonstrations) sets of k pairs (fewer where the pool is smaller),
    drawn with `seed`, round robin over the components that have a pool; each component's sets come from its best
    rewarded pairs first (module docstring, step 3; a pair with no reward counts as full)."""
    rng = random.Random(seed)
    names = [n for n, pairs in sorted(pool.items()) if pairs]
    draws = {n: _best_first(pool[n], k, rng) for n in names}
    sets: list[tuple[str, list[dict]]] = []
    while names and len(sets) < count:
        for name in list(names):
            chosen = next(draws[name], None)
            if chosen is None:
                names.remove(name)
            elif len(sets) < count:
                sets.append((name, chosen))
    return sets


def _best_first(pairs: list[dict], k: int, rng: random.Random):
    """Different sets of min(k, len(pairs)) pairs: drawn from the pairs of the best reward levels that hold k, then
    from the pairs of one level more, and so on (a level is left after 20 draws in a row gave no new set)."""
    size = min(k, len(pairs))
    levels = sorted({p.get("reward", 1.0) for p in pairs}, reverse=True)
    seen: set[tuple[str, ...]] = set()
    for level in levels:
        eligible = [p for p in pairs if p.get("reward", 1.0) >= level]
        if len(eligible) < size:
            continue
        misses = 0
        while misses < 20:
            chosen = rng.sample(eligible, size)
            mark = tuple(sorted(p["user"] for p in chosen))
            if mark in seen:
                misses += 1
                continue
            misses = 0
            seen.add(mark)
            yield chosen


class DemosProposer:
    def __init__(self, evaluator: Evaluator, calls_of: Callable[[list[str]], list[dict]], state_path: Path,
                 k: int, sets: int, min_reward: float, seed: int, syntax: ToolFormat | None = None):
        self.evaluator, self.calls_of, self.state_path = evaluator, calls_of, Path(state_path)
        self.syntax = syntax
        self.k, self.sets, self.min_reward, self.seed = k, sets, min_reward, seed

    def _state(self) -> dict:
        if self.state_path.is_file():
            return json.loads(self.state_path.read_text())
        return {}

    def _save(self, state: dict) -> None:
        partial = self.state_path.with_suffix(".tmp")
        partial.write_text(json.dumps(state, indent=2, ensure_ascii=False) + "\n")
        partial.replace(self.state_path)

    def _pool(self, train: list[Task]) -> dict[str, list[dict]]:
        train_ids = {t.task_id for t in train}
        rewards = {rollout_id: result.rewards[i] if i < len(result.rewards) else None
                   for (_, task_id), result in sorted(self.evaluator.log.results.items()) if task_id in train_ids
                   for i, rollout_id in enumerate(result.rollout_ids)}
        return demo_pool(self.calls_of(sorted(rewards)), rewards, self.evaluator.components, self.min_reward,
                         self.syntax)

    def run(self, start: dict[str, str], train: list[Task], val: list[Task]) -> DemosOutcome:
        start_key = self.evaluator.key(start)
        state = self._state()
        if state.get("start") != start_key:  # a new start (or a first run): draw the pool from the store
            self.evaluator.evaluate(start, train, "demonstrations: train split")
            state = {"start": start_key, "pool": self._pool(train), "sets": []}
            self._save(state)
        start_score = _mean(self.evaluator.evaluate(start, val, "demonstrations: validation"))
        best, best_score = start, start_score
        scored = {s["key"]: s for s in state["sets"]}
        for number, (name, demos) in enumerate(demo_sets(state["pool"], self.k, self.sets, self.seed), 1):
            candidate = with_demos(start, name, demos)
            key = self.evaluator.key(candidate)
            if key not in scored:
                score = _mean(self.evaluator.evaluate(candidate, val, f"demonstrations: set {number}"))
                scored[key] = {"key": key, "component": name, "demos": demos, "val_score": score}
                state["sets"] = list(scored.values())
                self._save(state)
            score = scored[key]["val_score"]
            log.info("demonstrations set %d (%s, candidate %s): validation %.3f", number, name, key, score)
            if best_score is None or score > best_score:
                best, best_score = candidate, score
        if not any(state["pool"].values()):
            log.warning("no train-split call earned reward >= %s: the demonstrations proposer has nothing to "
                        "show the model", self.min_reward)
        return DemosOutcome(best, best_score, start_score, len(scored),
                            {n: len(p) for n, p in state["pool"].items()})


def _mean(results) -> float:
    return sum(r.score for r in results) / len(results) if results else 0.0


__all__ = ["DemosProposer", "DemosOutcome", "demo_pool", "demo_sets", "demo_pair"]
