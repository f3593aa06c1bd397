"""Loss functions of the trainer: small pure functions on padded tensors, each tested on hand-computed values.

Shapes: B samples (transitions), T completion positions (right-padded).
    logp, old_logp, ref_logp   [B, T] float   log-probabilities of the completion tokens
    advantages                 [B]    float   one advantage per sample (DESIGN §4), or [B, T]: one per token
    mask                       [B, T] float   1 on tokens the policy generated (loss_mask), 0 on gaps/padding
    rollout                    [B]    long    index of each sample's rollout (for per-rollout weighting)

GRPO token objective (PPO clipping, DeepSeekMath's GRPO; ratios against the *sampling* logprobs that the
gateway recorded, so the first step is not assumed on-policy):
    ratio_t = exp(logp_t - old_logp_t)
    pg_t    = -min(ratio_t * A, clip(ratio_t, 1 - eps, 1 + eps) * A)
    kl_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1         (k3 estimator, >= 0)
    l_t     = pg_t + beta * kl_t
The loss is sum_t w_t * l_t with token weights w = mask * scale, scale from an AGGREGATIONS entry (the
weights sum to 1 over the batch):
    token     every trained token of the batch weighs the same (DAPO's token-level mean)
    sequence  mean over a sample's tokens, then over samples (the GRPO paper)
    rollout   mean over a sample's tokens, then over the samples of one rollout, then over rollouts: every
              rollout weighs the same however many turns it has (DESIGN §4, the default)
The trainer never branches on these names; it looks them up.

Truncated importance sampling (`tis_cap` > 0; decoupled PPO as in AReaL, with truncated importance weights).
The sampler (vLLM, often bf16) and the learner disagree a little on the same weights, and an asynchronous round
samples from an older policy: the behaviour logprobs b_t the gateway recorded are then not the learner's. Before
a pass's first update the learner scores every transition itself (no grad): the proximal logprobs p_t. Then
    ratio_t = exp(logp_t - p_t)                       (the clipping is around the learner's own policy)
    w_t     = min(exp(p_t - b_t), tis_cap)            (no grad; 1 where no behaviour logprob was recorded)
    pg_t    = -w_t * min(ratio_t * A, clip(ratio_t, 1 - eps, 1 + eps) * A)
The KL term is not weighted. Reported: the share of trained tokens whose weight the cap truncated, and the
mean weight over trained tokens. With tis_cap = 0 the ratio is against b_t, as above, with no weight.

REINFORCE++ (Hu et al. 2025; `advantage = "reinforce-pp"`, a TOKEN_RETURNS entry): the KL is a reward, not a
loss term. With beta = `kl` and KL_t = old_logp_t - ref_t (the sampling policy against the reference):
    r_t = -beta * KL_t on trained tokens, + G (the sample's return, credit.py) at its last trained token
    G_t = sum_{t' >= t} r_t'
    A_t = (G_t - mean) / (std + eps), mean and sample std over every trained token of the round
and the loss is the clipped objective above with A_t per token and no k3 term. Departures from the paper:
the discount gamma counts LLM calls (DESIGN §4) and is already in G, so tokens within one completion are not
discounted; a transition's return carries its own KL penalties, not those of the rollout's later calls.
With kl = 0 it is REINFORCE with a global baseline over the round's tokens: credit.py's reinforce_pp
advantage, the same for every token of a transition (the trainer still computes it per token).

PPO with a learned critic (`advantage = "ppo"`, a CRITIC_ADVANTAGES entry; train/critic.py holds the critic).
Turn-level: one step is one transition (an LLM call) of a rollout, in turn order; its state is the prompt, and
V_t the critic's value at the prompt's last token. The per-turn rewards are those hierarchical credit placed
(credit.py's returns G_t, episode and intermediate rewards alike), recovered from the returns:
    r_t = G_t - gamma * G_{t+1}                      (G after the last turn = 0)
so that sum_k gamma**k r_{t+k} = G_t whatever the scopes. Then GAE (Schulman et al. 2016):
    delta_t = r_t + gamma * V_{t+1} - V_t             (V after the last turn = 0)
    A_t     = delta_t + gamma * lam * A_{t+1}
    R_t     = A_t + V_t                               (the value target; with lam = 1, R_t = G_t)
A_t is normalised over the pass's transitions ((A - mean) / (std + eps), sample std) and used as every token's
advantage in the clipped objective above. The critic learns from the clipped value loss
    l_b = max((V_b - R_b)^2, (clip(V_b, V_old_b - eps_v, V_old_b + eps_v) - R_b)^2)
weighted like the policy loss (sum over the step of each sample's share of the token weights), V_old the values
before the pass's first update. eps_v = value_clip; 0 turns the clipping off.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from lightning_otel.train.transitions.credit import EPS


def scale_token(counts: torch.Tensor, rollout: torch.Tensor) -> torch.Tensor:
    return torch.full_like(counts, 1.0) / counts.sum().clamp(min=1.0)


def scale_sequence(counts: torch.Tensor, rollout: torch.Tensor) -> torch.Tensor:
    has_tokens = (counts > 0).float()
    return has_tokens / counts.clamp(min=1.0) / has_tokens.sum().clamp(min=1.0)


def scale_rollout(counts: torch.Tensor, rollout: torch.Tensor) -> torch.Tensor:
    has_tokens = (counts > 0).float()
    _, index = torch.unique(rollout, return_inverse=True)
    samples_per_rollout = torch.zeros(int(index.max()) + 1, dtype=counts.dtype).index_add_(0, index, has_tokens)
    rollouts = (samples_per_rollout > 0).float().sum().clamp(min=1.0)
    return has_tokens / counts.clamp(min=1.0) / samples_per_rollout[index].clamp(min=1.0) / rollouts


# Each maps (trained tokens per sample [B] float, rollout index [B]) to a per-sample scale [B]; the token
# weights are mask * scale[:, None] and sum to 1 over the batch. Computed once per optimizer step, so
# micro-batches of one step share the statistics.
AGGREGATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "token": scale_token,
    "sequence": scale_sequence,
    "rollout": scale_rollout,
}


def token_weights(mask: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return mask * scale[:, None]


@dataclass
class LossOutput:
    loss: torch.Tensor        # scalar, differentiable
    kl: float                 # weighted mean k3 KL to the reference (0 without a KL term)
    clip_fraction: float      # fraction of trained tokens whose gradient the clipping removed
    ratio_mean: float
    logprob_gap: float = 0.0  # mean |logp - old_logp| over trained tokens: learner vs sampler disagreement
    # Weighted like the loss (the token weights sum to 1 over a step, so micro-batches' parts add up to the step's):
    entropy: float | None = None    # entropy of the policy's next-token distribution (None: not computed)
    approx_kl: float | None = None  # k3 estimate of KL(old || current), the sampler's tokens (None: not a ratio loss)
    has_kl: bool = False            # the loss has the k3 KL-to-reference term (`kl` is its value)
    critic_loss: torch.Tensor | None = None  # scalar, differentiable in the critic's parameters only (PPO)
    value_clip_fraction: float = 0.0
    # Truncated importance sampling (None: off): over the trained tokens, how many there are, how many had their
    # weight truncated by the cap, and the sum of their weights (sums, so micro-batches and ranks add up).
    tis_tokens: float | None = None
    tis_truncated: float | None = None
    tis_weight_sum: float | None = None


def weighted(values: torch.Tensor | None, weights: torch.Tensor) -> float | None:
    """sum(values * weights) over the weighted positions (values elsewhere, padding included, are not read)."""
    if values is None:
        return None
    with torch.no_grad():
        return float(torch.where(weights > 0, values.detach() * weights, torch.zeros_like(weights)).sum())


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1.0


def truncated_is_weights(prox_logp: torch.Tensor, behaviour_logp: torch.Tensor,
                         cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The importance weights w = min(exp(prox - behaviour), cap) [B, T], no grad, 1 where `behaviour_logp` is
    NaN (no record); and where the cap truncated them [B, T] bool."""
    with torch.no_grad():
        recorded = ~torch.isnan(behaviour_logp)
        raw = torch.exp(prox_logp.detach() - torch.where(recorded, behaviour_logp, prox_logp.detach()))
        truncated = recorded & (raw > cap)
        return torch.where(recorded, raw.clamp(max=cap), torch.ones_like(raw)), truncated


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
              clip: float = 0.2, kl_coef: float = 0.0, ref_logp: torch.Tensor | None = None,
              entropy: torch.Tensor | None = None, behaviour_logp: torch.Tensor | None = None,
              tis_cap: float = 0.0) -> LossOutput:
    """The clipped GRPO objective weighted by `weights` (token_weights of an AGGREGATIONS scale); `advantages`
    [B] (one per sample) or [B, T] (one per token). `entropy` [B, T] (no grad), when given, is reported weighted
    like the loss; so is approx_kl = (ratio - 1) - log ratio, the k3 estimate of KL(old || current).
    With `tis_cap` > 0 and `behaviour_logp` (the sampler's, NaN where none was recorded), `old_logp` is the
    proximal policy's and each token's policy term is weighted by truncated_is_weights(old, behaviour, tis_cap);
    logprob_gap is then measured against the behaviour logprobs."""
    ratio = torch.exp(logp - old_logp)
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, 1.0 - clip, 1.0 + clip) * adv)
    tis = tis_cap > 0 and behaviour_logp is not None
    if tis:
        is_weights, truncated = truncated_is_weights(old_logp, behaviour_logp, tis_cap)
        per_token = per_token * is_weights
    kl_value = 0.0
    if kl_coef and ref_logp is not None:
        kl = k3_kl(logp, ref_logp)
        per_token = per_token + kl_coef * kl
        kl_value = float((kl.detach() * weights).sum())
    trained = weights > 0
    with torch.no_grad():
        # clipping is active where it removes the gradient: the ratio left the range on the side A pushes
        clipped = (((ratio > 1.0 + clip) & (adv > 0)) | ((ratio < 1.0 - clip) & (adv < 0))) & trained
        count = trained.sum().clamp(min=1)
        clip_fraction = float(clipped.sum() / count)
        ratio_mean = float((ratio * trained).sum() / count)
        sampled = old_logp if not tis else torch.where(torch.isnan(behaviour_logp), logp, behaviour_logp)
        gap = float(((logp - sampled).abs() * trained).sum() / count)
        log_ratio = logp - old_logp
        approx_kl = weighted(torch.exp(log_ratio) - 1.0 - log_ratio, weights)
    out = LossOutput((per_token * weights).sum(), kl_value, clip_fraction, ratio_mean, gap,
                     entropy=weighted(entropy, weights), approx_kl=approx_kl,
                     has_kl=bool(kl_coef and ref_logp is not None))
    if tis:
        out.tis_tokens = float(trained.sum())
        out.tis_truncated = float((truncated & trained).sum())
        out.tis_weight_sum = float(torch.where(trained, is_weights, torch.zeros_like(is_weights)).sum())
    return out


def sft_loss(logp: torch.Tensor, weights: torch.Tensor, entropy: torch.Tensor | None = None) -> LossOutput:
    """Negative log-likelihood of the target tokens, weighted like the GRPO loss."""
    return LossOutput(-(logp * weights).sum(), 0.0, 0.0, 1.0, entropy=weighted(entropy, weights))


def kl_penalised_returns(old_logp: torch.Tensor, ref_logp: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                         beta: float) -> torch.Tensor:
    """REINFORCE++ token returns G_t [B, T]: r_t = -beta * (old_logp_t - ref_t) on trained tokens, plus the
    sample's return `returns` [B] at its last trained token, summed from t to the end of the completion.
    Positions off the mask have r_t = 0 (their log-probabilities may be NaN or 0: they are not read)."""
    rewards = torch.where(mask > 0, -beta * (old_logp - ref_logp), torch.zeros_like(mask))
    trained = mask > 0
    T = mask.shape[1]
    # the last trained position of each row: T - 1 minus its distance from the right end
    last = (T - 1 - torch.flip(trained, dims=[1]).float().argmax(dim=1)).clamp(min=0)
    rewards = rewards.index_put((torch.arange(mask.shape[0]), last), returns * trained.any(dim=1), accumulate=True)
    return torch.flip(torch.cumsum(torch.flip(rewards, dims=[1]), dim=1), dims=[1])


def normalise_tokens(values: list[torch.Tensor], masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """(v - mean) / (std + eps) for each tensor of `values`, mean and sample std (n - 1) taken over the
    trained positions (mask > 0) of all of them together: the round's global baseline; 0 off the mask. With
    one trained token there is no spread: it gets 0."""
    pooled = torch.cat([v[m > 0] for v, m in zip(values, masks)]) if values else torch.zeros(0)
    mean = pooled.mean() if pooled.numel() else torch.tensor(0.0)
    std = pooled.std() if pooled.numel() > 1 else torch.tensor(0.0)
    return [torch.where(m > 0, (v - mean) / (std + EPS), torch.zeros_like(v)) for v, m in zip(values, masks)]


# Advantage names (credit.ADVANTAGES) whose advantages the trainer computes per token at update time, with the
# KL to the reference as a penalty in the rewards (`kl` is then beta, and the loss has no k3 term).
TOKEN_RETURNS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]] = {
    "reinforce-pp": kl_penalised_returns,
}


def turn_rewards(returns: list[float], gamma: float) -> list[float]:
    """Per-turn rewards r_t = G_t - gamma * G_{t+1} of one rollout's returns in turn order (G_n = 0)."""
    return [g - gamma * (returns[t + 1] if t + 1 < len(returns) else 0.0) for t, g in enumerate(returns)]


def gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """GAE over the turns of one rollout: (advantages A_t, value targets R_t = A_t + V_t); the state after the
    last turn is terminal (value 0)."""
    if len(rewards) != len(values):
        raise ValueError(f"gae: {len(rewards)} rewards but {len(values)} values")
    advantages = [0.0] * len(rewards)
    following = next_value = 0.0
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * next_value - values[t]
        following = delta + gamma * lam * following
        advantages[t], next_value = following, values[t]
    return advantages, [a + v for a, v in zip(advantages, values)]


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor,
                       clip: float) -> tuple[torch.Tensor, float]:
    """PPO's clipped value loss sum_b w_b * max((V - R)^2, (clip(V, V_old - clip, V_old + clip) - R)^2), all [B]
    (`weights` [B] sum to 1 over the step; clip = 0: the plain squared error); and the fraction of weighted samples
    whose gradient the clipping removed."""
    plain = (values - targets) ** 2
    if not clip:
        return (plain * weights).sum(), 0.0
    clipped = (old_values + torch.clamp(values - old_values, -clip, clip) - targets) ** 2
    with torch.no_grad():
        counted = weights > 0
        fraction = float(((clipped > plain) & counted).sum() / counted.sum().clamp(min=1))
    return (torch.maximum(plain, clipped) * weights).sum(), fraction


def ppo_advantages(returns: list[float], values: list[float], gamma: float,
                   lam: float) -> tuple[list[float], list[float]]:
    """One rollout's (A_t, R_t) from its credit returns G_t and values V_t, in turn order."""
    return gae(turn_rewards(returns, gamma), values, gamma, lam)


# Advantage names (credit.ADVANTAGES) whose advantages come from a learned value model: the learner trains a
# critic beside the policy (train/critic.py), and before a pass's first update the trainer computes every
# transition's values and advantages with this function (per rollout: returns, values, gamma, lam).
CRITIC_ADVANTAGES: dict[str, Callable[[list[float], list[float], float, float], tuple[list[float], list[float]]]] = {
    "ppo": ppo_advantages,
}
