"""One pass of optimizer steps over a set of transitions: GRPO (advantages) or SFT (targets), under DeepSpeed.

Steps hold `batch_size` transitions, split into micro-batches of `micro_batch` for the forward pass. The
token weights of a step are computed once over all its transitions (losses.AGGREGATIONS), so micro-batching
does not change the loss. With `group_steps` (and prefix sharing on), an epoch's order keeps transitions whose
prompts share most of their tokens together (the samples and turns of one task; the SFT questions of one
database, whose prompts are mostly its schema): the groups are shuffled and so are the members of each, then
cut into steps, so that a step's micro-batches run those long common starts once instead of once per row.
Transitions without sampling logprobs (re-tokenised ones) use the current policy's own logprobs as the old
ones (ratio 1 at the first epoch).

Token-level advantages (`advantage = "reinforce-pp"`, losses.TOKEN_RETURNS): their normalisation takes every
trained token of the pass, so before the first step one no-grad pass over all the transitions scores them with
the reference policy (with kl_reward > 0), and each transition gets its `token_advantages`; the steps then use those.

Advantages from a critic (`advantage = "ppo"`, losses.CRITIC_ADVANTAGES): before the first step one no-grad pass
gives every transition the critic's value V_old; GAE over each rollout's turns gives its advantage (normalised
over the pass) and value target; each step then adds the clipped value loss, which trains the critic alone.

Truncated importance sampling (`tis_cap` > 0, losses.truncated_is_weights): before the first step one no-grad
pass gives every transition the learner's own logprobs (`prox_logprobs`, the proximal policy); the steps clip the
ratio around those and weight each token by its truncated importance weight against the recorded (behaviour)
logprobs. Like V_old, they are computed once per pass (call of optimize), not per epoch; a resumed pass computes
them again with the resumed learner.
"""
from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from lightning_otel.train import distributed
from lightning_otel.train.batch import Batch, collate, common_prefix, plan_micro_batches
from lightning_otel.train.config import TrainConfig
from lightning_otel.train.learner import Learner
from lightning_otel.train.losses import (AGGREGATIONS, CRITIC_ADVANTAGES, TOKEN_RETURNS, LossOutput, clipped_value_loss,
                                         grpo_loss, normalise_tokens, sft_loss, token_weights)
from lightning_otel.train.transitions.credit import EPS
from lightning_otel.train.transitions.record import Transition

log = logging.getLogger(__name__)


@dataclass
class StepStats:
    steps: int = 0
    samples: int = 0
    trained_tokens: int = 0
    skipped_too_long: int = 0
    loss: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    clip_fraction: list[float] = field(default_factory=list)
    ratio_mean: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)  # each step's gradient norm before clipping
    entropy: list[float] = field(default_factory=list)    # each step's policy entropy, weighted like the loss
    approx_kl: list[float] = field(default_factory=list)  # each step's k3 KL(old || current) (ratio losses)
    ranks: int = 1  # processes the steps ran on (train/distributed.py)
    reward_kl: float | None = None  # token-level advantages with kl_reward > 0: mean old_logp - ref_logp over the pass
    value_loss: list[float] = field(default_factory=list)           # PPO: each step's clipped value loss
    value_clip_fraction: list[float] = field(default_factory=list)  # PPO: per micro-batch
    value_mean: float | None = None          # PPO: the critic's mean value over the pass, before its updates
    explained_variance: float | None = None  # PPO: 1 - Var(R - V_old) / Var(R) over the pass (1: a perfect critic)
    # Truncated importance sampling (tis_cap > 0), summed over the pass's trained tokens (all ranks):
    tis_tokens: float = 0.0
    tis_truncated: float = 0.0     # tokens whose weight the cap truncated
    tis_weight_sum: float = 0.0
    # The first micro-batch runs before any update of the pass: its policy is the one that sampled, so its ratio
    # should be ~1 and its clip fraction ~0; anything else means the learner and the engine disagree (with tis_cap
    # the ratio is against the learner's own proximal logprobs, ~1 by construction: logprob_gap still compares).
    first: LossOutput | None = None
    seconds: float = 0.0

    def summary(self, prefix: str = "") -> dict:
        def mean(values: list[float]) -> float | None:
            return sum(values) / len(values) if values else None

        return {f"{prefix}steps": self.steps, f"{prefix}samples": self.samples,
                f"{prefix}trained_tokens": self.trained_tokens, f"{prefix}skipped_too_long": self.skipped_too_long,
                f"{prefix}loss": mean(self.loss), f"{prefix}kl": mean(self.kl),
                f"{prefix}clip_fraction": mean(self.clip_fraction), f"{prefix}ratio_mean": mean(self.ratio_mean),
                f"{prefix}grad_norm": mean(self.grad_norm), f"{prefix}entropy": mean(self.entropy),
                f"{prefix}approx_kl": mean(self.approx_kl), f"{prefix}ranks": self.ranks,
                f"{prefix}reward_kl": self.reward_kl, f"{prefix}value_loss": mean(self.value_loss),
                f"{prefix}value_clip_fraction": mean(self.value_clip_fraction),
                f"{prefix}value_mean": self.value_mean, f"{prefix}explained_variance": self.explained_variance,
                f"{prefix}tis_truncated_fraction": self.tis_truncated / self.tis_tokens if self.tis_tokens else None,
                f"{prefix}tis_weight_mean": self.tis_weight_sum / self.tis_tokens if self.tis_tokens else None,
                f"{prefix}first_ratio_mean": self.first.ratio_mean if self.first else None,
                f"{prefix}first_clip_fraction": self.first.clip_fraction if self.first else None,
                f"{prefix}first_logprob_gap": self.first.logprob_gap if self.first else None,
                f"{prefix}train_seconds": self.seconds,
                f"{prefix}tokens_per_second": self.trained_tokens / self.seconds if self.seconds else None}


Loss = Callable[[Learner, Batch, torch.Tensor, TrainConfig], LossOutput]
StepCallback = Callable[[int, dict[str, float]], None]  # (optimizer steps of the run so far, the step's metrics)


def grpo_objective(learner: Learner, batch: Batch, weights: torch.Tensor, config: TrainConfig) -> LossOutput:
    # The policy is the distribution rollouts sampled from: logits / temperature (the engine records the
    # logprobs of that same distribution). SFT below stays at temperature 1.
    # Rows with value targets (a critic's advantages) also give the critic its loss, from the same forward pass,
    # as does the entropy. Rows with proximal logprobs (truncated importance sampling) take the ratio against
    # them, and the recorded (behaviour) logprobs give the importance weights.
    critic = batch.value_targets is not None
    scores, values = learner.scores_and_values(batch, config.temperature) if critic else \
        (learner.scores(batch, config.temperature), None)
    logp = scores.logp
    old = batch.old_logp if batch.prox_logp is None else batch.prox_logp
    old = torch.where(torch.isnan(old), logp.detach(), old)
    behaviour = None if batch.prox_logp is None else batch.old_logp
    ref = learner.reference_logprobs(batch, config.temperature) if config.kl_loss else None
    out = grpo_loss(logp, old, batch.advantages, weights, clip=config.clip, kl_coef=config.kl_loss, ref_logp=ref,
                    entropy=scores.entropy, behaviour_logp=behaviour, tis_cap=config.tis_cap)
    if critic:
        # each sample's share of the step's policy loss weighs its value error: both sum to 1 over the step
        out.critic_loss, out.value_clip_fraction = clipped_value_loss(
            values, batch.old_values.to(values.device), batch.value_targets.to(values.device),
            weights.sum(dim=1).to(values.device), config.value_clip)
    return out


def sft_objective(learner: Learner, batch: Batch, weights: torch.Tensor, config: TrainConfig) -> LossOutput:
    scores = learner.scores(batch)
    return sft_loss(scores.logp, weights, scores.entropy)


def with_token_advantages(learner: Learner, rows: list[Transition], config: TrainConfig,
                          stats: StepStats) -> list[Transition]:
    """The rows with `token_advantages` when config.advantage has token returns (losses.TOKEN_RETURNS), else
    as given. One no-grad pass before any update: the reference scores every trained token (with kl_reward > 0),
    the old logprobs are the engine's (the current policy's where none were recorded), and the returns are
    normalised over all the rows' trained tokens together."""
    token_returns = TOKEN_RETURNS.get(config.advantage)
    if token_returns is None or not rows:
        return rows
    returns: list[torch.Tensor] = [torch.zeros(0)] * len(rows)
    masks: list[torch.Tensor] = [torch.zeros(0)] * len(rows)
    kl_sum = kl_tokens = 0.0
    plans = plan_micro_batches(rows, config.micro_batch, config.share_prefix, config.micro_batch_tokens)
    with torch.no_grad():
        for indices, prefix_len in plans:
            batch = collate([rows[j] for j in indices], learner.pad_id, None, prefix_len)
            old = ref = torch.zeros_like(batch.mask)
            if config.kl_reward:
                ref = learner.reference_logprobs(batch, config.temperature)
                old = batch.old_logp
                if bool((torch.isnan(old) & (batch.mask > 0)).any()):  # re-tokenised rows: the policy that sampled
                    old = torch.where(torch.isnan(old), learner.logprobs(batch, config.temperature), old)
                kl_sum += float(torch.where(batch.mask > 0, old - ref, 0.0).sum())
                kl_tokens += float(batch.mask.sum())
            sample_returns = torch.tensor([float(rows[j]["return"]) for j in indices])
            token = token_returns(old, ref, sample_returns, batch.mask, config.kl_reward)
            T = batch.completion_width
            for k, j in enumerate(indices):
                c = len(rows[j]["completion_ids"])
                returns[j], masks[j] = token[k, T - c:], batch.mask[k, T - c:]
    if config.kl_reward:
        stats.reward_kl = kl_sum / kl_tokens if kl_tokens else None
    advantages = normalise_tokens(returns, masks)
    return [{**row, "token_advantages": a.tolist()} for row, a in zip(rows, advantages)]


def with_critic_advantages(learner: Learner, rows: list[Transition], config: TrainConfig,
                           stats: StepStats) -> list[Transition]:
    """The rows with `value_old` (the critic's value of the row's state, before any update of the pass),
    `value_target` and `advantage` (normalised over the rows) when config.advantage takes its advantages from a
    critic (losses.CRITIC_ADVANTAGES), else as given. Each rollout's rows, in turn order, are its trajectory."""
    advantages_of = CRITIC_ADVANTAGES.get(config.advantage)
    if advantages_of is None or not rows:
        return rows
    values = [0.0] * len(rows)
    plans = plan_micro_batches(rows, config.micro_batch, config.share_prefix, config.micro_batch_tokens)
    for indices, prefix_len in plans:
        batch = collate([rows[j] for j in indices], learner.pad_id, None, prefix_len)
        for j, v in zip(indices, learner.values(batch).tolist()):
            values[j] = v
    by_rollout: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        by_rollout.setdefault(row.get("rollout_id") or str(i), []).append(i)
    raw, targets = [0.0] * len(rows), [0.0] * len(rows)
    for members in by_rollout.values():
        members.sort(key=lambda i: rows[i].get("turn") or 0)
        a, r = advantages_of([float(rows[i]["return"]) for i in members], [values[i] for i in members],
                             config.gamma, config.lam)
        for i, a_i, r_i in zip(members, a, r):
            raw[i], targets[i] = a_i, r_i
    advantage = torch.tensor(raw, dtype=torch.float64)
    spread = float(advantage.std()) if len(rows) > 1 else 0.0
    normalised = ((advantage - advantage.mean()) / (spread + EPS)).tolist() if len(rows) > 1 else [0.0]
    target = torch.tensor(targets, dtype=torch.float64)
    if len(rows) > 1 and float(target.var()) > 0:
        residual = target - torch.tensor(values, dtype=torch.float64)
        stats.explained_variance = 1.0 - float(residual.var() / target.var())
    stats.value_mean = sum(values) / len(values)
    return [{**row, "advantage": a, "value_old": v, "value_target": r}
            for row, a, v, r in zip(rows, normalised, values, targets)]


def with_proximal_logprobs(learner: Learner, rows: list[Transition], config: TrainConfig,
                           stats: StepStats) -> list[Transition]:
    """The rows with `prox_logprobs` (the learner's own logprob of each completion token, before any update of the
    pass: the proximal policy of truncated importance sampling) when config.tis_cap > 0, else as given. One
    no-grad forward pass per micro-batch."""
    if not config.tis_cap or not rows:
        return rows
    prox: list[list[float]] = [[] for _ in rows]
    plans = plan_micro_batches(rows, config.micro_batch, config.share_prefix, config.micro_batch_tokens)
    with torch.no_grad():
        for indices, prefix_len in plans:
            batch = collate([rows[j] for j in indices], learner.pad_id, None, prefix_len)
            logp = learner.logprobs(batch, config.temperature).float().cpu()
            T = batch.completion_width
            for k, j in enumerate(indices):
                prox[j] = logp[k, T - len(rows[j]["completion_ids"]):].tolist()
    return [{**row, "prox_logprobs": p} for row, p in zip(rows, prox)]


# What the GRPO loss needs computed over a pass's transitions before its first update, in order; each entry is a
# no-op unless the config asks for it (an advantage in its registry, or tis_cap > 0).
GRPO_PREPARES = (with_token_advantages, with_critic_advantages, with_proximal_logprobs)


def prepare_grpo(learner: Learner, rows: list[Transition], config: TrainConfig,
                 stats: StepStats) -> list[Transition]:
    """The advantages (and proximal logprobs) computed at update time: every GRPO_PREPARES entry in turn."""
    for prepare in GRPO_PREPARES:
        rows = prepare(learner, rows, config, stats)
    return rows


@dataclass(frozen=True)
class Objective:
    loss: Loss
    # Once over a pass's transitions, before its first step: what the loss needs beyond each row's own fields.
    prepare: Callable[[Learner, list[Transition], TrainConfig, StepStats], list[Transition]] | None = None


OBJECTIVES: dict[str, Objective] = {"grpo": Objective(grpo_objective, prepare_grpo),
                                    "sft": Objective(sft_objective)}


def fits(row: dict, max_length: int) -> bool:
    return 0 < len(row["prompt_ids"]) and 0 < len(row["completion_ids"]) and \
        len(row["prompt_ids"]) + len(row["completion_ids"]) <= max_length


def prompt_groups(rows: list[Transition], min_shared: int) -> list[list[int]]:
    """Row indices in groups whose prompts, in sorted order, each share with the previous one at least half
    of the shorter prompt and at least `min_shared` tokens (a short common header alone does not count)."""
    order = sorted(range(len(rows)), key=lambda i: list(rows[i]["prompt_ids"]))
    groups: list[list[int]] = []
    for i in order:
        if groups:
            previous = rows[groups[-1][-1]]["prompt_ids"]
            prompt = rows[i]["prompt_ids"]
            shared = common_prefix(previous, prompt)
            if shared >= max(min_shared, min(len(previous), len(prompt)) / 2):
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


def epoch_order(rows: list[Transition], rng: random.Random,
                groups: list[list[int]] | None) -> list[Transition]:
    if groups is None:
        shuffled = rows[:]
        rng.shuffle(shuffled)
        return shuffled
    mixed = [members[:] for members in groups]
    for members in mixed:
        rng.shuffle(members)
    rng.shuffle(mixed)
    return [rows[i] for members in mixed for i in members]


def optimize(learner: Learner, rows: list[Transition], config: TrainConfig, objective: str, seed: int,
             epochs: int = 1, progress: Callable[[int, int], None] | None = None, start_step: int = 0,
             on_step: StepCallback | None = None) -> StepStats:
    """Run `epochs` shuffled passes of optimizer steps over `rows` (transition dicts). `start_step` skips the
    first steps of that same order (the learner's state was saved after them); `progress(step, total)` follows
    every step, counted from the first; `on_step(optimizer_steps, metrics)` gets each step's metrics (see
    _step) with the run's optimizer step count after it. With several ranks, rank 0's call is made by all of
    them (train/distributed.py) and each runs its share of every step's micro-batches; only rank 0's on_step
    is called, with figures over all ranks."""
    distributed.announce("optimize", {"rows": rows, "config": config, "objective": objective, "seed": seed,
                                      "epochs": epochs, "start_step": start_step})
    chosen = OBJECTIVES[objective]
    stats = StepStats(ranks=learner.world)
    usable = [r for r in rows if fits(r, config.max_length)]
    stats.skipped_too_long = len(rows) - len(usable)
    if stats.skipped_too_long:
        log.warning("%d transition(s) longer than max_length=%d (or empty) skipped", stats.skipped_too_long,
                    config.max_length)
    order = random.Random(seed)
    total = epochs * math.ceil(len(usable) / config.batch_size)
    learner.train_mode(True)
    started = time.perf_counter()
    if chosen.prepare:
        usable = chosen.prepare(learner, usable, config, stats)
    groups = prompt_groups(usable, config.share_prefix) if config.group_steps and config.share_prefix else None
    step = 0
    for _ in range(epochs):
        shuffled = epoch_order(usable, order, groups)
        for start in range(0, len(shuffled), config.batch_size):
            step += 1
            if step <= start_step:
                continue
            metrics = _step(learner, shuffled[start:start + config.batch_size], config, chosen.loss, stats)
            if on_step:
                on_step(learner.optimizer_steps, metrics)
            if progress:
                progress(step, total)
    stats.seconds = time.perf_counter() - started
    return stats


def _step(learner: Learner, rows: list[Transition], config: TrainConfig, loss_fn: Loss,
          stats: StepStats) -> dict[str, float]:
    """One optimizer step. Returns its metrics over all ranks: loss, lr, grad_norm (when DeepSpeed computed it),
    entropy (weighted like the loss), and for ratio losses approx_kl (weighted like the loss), clip_fraction
    (mean over the step's micro-batches), with a KL term kl (to the reference, weighted like the loss), and with
    truncated importance sampling tis_truncated_fraction and tis_weight_mean (over the step's trained tokens)."""
    rollout_index: dict[str, int] = {}
    full = collate(rows, learner.pad_id, rollout_index)
    scale = AGGREGATIONS[config.aggregation](full.mask.sum(dim=1), full.rollout)
    # Micro-batches: rows sharing a prompt start run it once; the others grouped by length so they pad little.
    # The token weights were fixed over the whole step above, so the grouping does not change the loss.
    plans = plan_micro_batches(rows, config.micro_batch, config.share_prefix, config.micro_batch_tokens)
    # With several ranks, micro-batch i runs on rank i mod world; a rank short of one runs the first with zero
    # weights, so that all make the same number of backward passes (and collective calls) per step.
    rank, world = learner.rank, learner.world
    mine = plans[rank::world]
    count = math.ceil(len(plans) / world)
    total = kl = entropy = approx_kl = clipped = value_total = tis_tokens = tis_truncated = tis_weight_sum = 0.0
    parts_seen = 0
    has_kl = ratio_loss = critic = tis = False
    for i in range(count):
        real = i < len(mine)
        indices, prefix_len = mine[i] if real else plans[0]
        batch = collate([rows[j] for j in indices], learner.pad_id, rollout_index, prefix_len)
        weights = token_weights(batch.mask, scale[indices])
        out = loss_fn(learner, batch, weights if real else torch.zeros_like(weights), config)
        learner.backward(out.loss, last_of_step=i == count - 1, critic_loss=out.critic_loss)
        if not real:
            continue
        total += float(out.loss.detach())  # weights sum to 1 over the step: the parts add up
        kl += out.kl
        entropy += out.entropy or 0.0
        approx_kl += out.approx_kl or 0.0
        clipped += out.clip_fraction
        parts_seen += 1
        has_kl, ratio_loss = has_kl or out.has_kl, ratio_loss or out.approx_kl is not None
        if out.tis_tokens is not None:
            tis = True
            tis_tokens += out.tis_tokens
            tis_truncated += out.tis_truncated
            tis_weight_sum += out.tis_weight_sum
        if out.critic_loss is not None:
            critic = True
            value_total += float(out.critic_loss.detach())
            stats.value_clip_fraction.append(out.value_clip_fraction)
        stats.clip_fraction.append(out.clip_fraction)
        stats.ratio_mean.append(out.ratio_mean)
        stats.first = stats.first or replace(out, loss=out.loss.detach(), critic_loss=None)
    if world > 1:  # the step's figures: the sum of every rank's parts
        parts = torch.tensor([total, kl, entropy, approx_kl, clipped, parts_seen, value_total, tis_tokens,
                              tis_truncated, tis_weight_sum], dtype=torch.float64)
        torch.distributed.all_reduce(parts)
        (total, kl, entropy, approx_kl, clipped, parts_seen, value_total, tis_tokens, tis_truncated,
         tis_weight_sum) = (float(x) for x in parts)
    metrics = {"loss": total, "lr": learner.learning_rate(), "entropy": entropy}
    if critic:
        stats.value_loss.append(value_total)
        metrics["value_loss"] = value_total
    if (norm := learner.grad_norm()) is not None:
        stats.grad_norm.append(norm)
        metrics["grad_norm"] = norm
    if ratio_loss:
        metrics |= {"approx_kl": approx_kl, "clip_fraction": clipped / max(parts_seen, 1)}
        stats.approx_kl.append(approx_kl)
    if has_kl:
        metrics["kl"] = kl
    if tis:
        metrics |= {"tis_truncated_fraction": tis_truncated / max(tis_tokens, 1.0),
                    "tis_weight_mean": tis_weight_sum / max(tis_tokens, 1.0)}
        stats.tis_tokens += tis_tokens
        stats.tis_truncated += tis_truncated
        stats.tis_weight_sum += tis_weight_sum
    stats.loss.append(total)
    stats.kl.append(kl)
    stats.entropy.append(entropy)
    stats.steps += 1
    stats.samples += len(rows)
    stats.trained_tokens += int(full.mask.sum())
    return metrics
