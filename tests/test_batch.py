"""Batches for the update step (train/batch.py): shared-prefix micro-batches give the same log-probs and the
same gradients as one padded sequence per transition, on the bundled model with LoRA adapters."""
import random

import pytest
import torch

from lightning_otel.train.batch import collate, completion_logprobs, plan_micro_batches
from lightning_otel.train.losses import AGGREGATIONS, grpo_loss, token_weights


def row(prompt, completion, rollout, advantage=0.0):
    return {"prompt_ids": list(prompt), "completion_ids": list(completion), "rollout_id": rollout,
            "advantage": advantage, "completion_logprobs": None, "loss_mask": None}


def test_rows_sharing_a_prompt_start_share_a_micro_batch():
    system = list(range(100, 140))  # 40 tokens every prompt of task A starts with
    rows = [row(system + [1, 2], [7], "a0"), row([5] * 50, [7], "x"), row(system + [1, 2], [8, 9], "a1"),
            row(system + [3], [7], "a2"), row([6] * 10, [7], "y"), row(system + [1, 2], [4], "a3")]
    plans = plan_micro_batches(rows, micro_batch=4, min_shared=16)
    assert sorted(i for indices, _ in plans for i in indices) == list(range(6))  # every row exactly once
    shared = [(sorted(indices), p) for indices, p in plans if p]
    assert shared == [([0, 2, 3, 5], 40)]  # the common start of all four, not more
    assert sorted(sorted(indices) for indices, p in plans if not p) == [[1, 4]]
    # prefix kept one token short of the shortest prompt: every tail predicts its first completion token
    identical = [row(system, [1], "b0"), row(system, [2], "b1")]
    assert plan_micro_batches(identical, 4, 16) == [([0, 1], 39)]


def test_micro_batches_hold_at_most_micro_batch_rows_and_short_overlaps_are_not_shared():
    rows = [row([1] * 30 + [k], [2], f"r{k}") for k in range(5)] + [row([1] * 10 + [9] * 5, [3], "s")]
    plans = plan_micro_batches(rows, micro_batch=2, min_shared=16)
    assert all(len(indices) <= 2 for indices, _ in plans)
    assert sorted(i for indices, _ in plans for i in indices) == list(range(6))
    assert all(p == 30 for indices, p in plans if 5 not in indices and len(indices) == 2)
    assert [p for indices, p in plans if 5 in indices] == [0]  # 10 common tokens < 16


def test_steps_are_filled_with_rows_that_share_most_of_their_prompt():
    from lightning_otel.train.optimize import epoch_order, prompt_groups

    header = list(range(1000, 1030))  # 30 tokens every prompt starts with (an instruction), then a schema
    schemas = {db: [db * 100 + k for k in range(200)] for db in (1, 2, 3)}
    rows = [row(header + schemas[db] + [db, q], [q], f"{db}-{q}") for q in range(5) for db in (1, 2, 3)]
    rows.append(row([9] * 40, [1], "lonely"))
    groups = prompt_groups(rows, min_shared=16)
    by_db = sorted(sorted(rows[i]["rollout_id"] for i in members) for members in groups)
    assert by_db == [[f"{db}-{q}" for q in range(5)] for db in (1, 2, 3)] + [["lonely"]]  # not one big group
    rng = random.Random(0)
    orders = [epoch_order(rows, rng, groups) for _ in range(3)]
    for order in orders:
        assert sorted(r["rollout_id"] for r in order) == sorted(r["rollout_id"] for r in rows)
        runs = [key for k, key in enumerate(r["rollout_id"][0] for r in order) if k == 0 or
                key != order[k - 1]["rollout_id"][0]]
        assert len(runs) == 4  # each group's rows sit together
    assert len({tuple(r["rollout_id"] for r in order) for order in orders}) == 3  # reshuffled every epoch
    plain = epoch_order(rows, random.Random(0), None)
    assert sorted(r["rollout_id"] for r in plain) == sorted(r["rollout_id"] for r in rows)


def test_a_token_budget_bounds_the_positions_of_every_micro_batch():
    rng = random.Random(5)
    rows = [row([rng.randrange(50, 60) for _ in range(rng.randrange(20, 400))], [1] * rng.randrange(1, 60), f"r{k}")
            for k in range(40)]
    rows += [row([7] * 300 + [k], [2] * 40, f"g{k}") for k in range(6)]  # a group sharing 300 tokens
    rows.append(row([9] * 900, [3] * 10, "long"))  # alone over the budget: its own micro-batch

    def positions(indices, shared):
        return shared + len(indices) * max(len(rows[i]["prompt_ids"]) + len(rows[i]["completion_ids"]) - shared
                                           for i in indices)

    for min_shared in (16, 0):
        plans = plan_micro_batches(rows, micro_batch=4, min_shared=min_shared, max_tokens=700)
        assert sorted(i for indices, _ in plans for i in indices) == list(range(len(rows)))
        assert all(len(indices) <= 4 for indices, _ in plans)
        assert all(positions(indices, p) <= 700 for indices, p in plans if len(indices) > 1)
        assert [len(indices) for indices, _ in plans if len(rows) - 1 in indices] == [1]
    shared = [(sorted(indices), p) for indices, p in plan_micro_batches(rows, 4, 16, 700) if p]
    # 300 + 4 x 41 = 464 positions fit: the group shares its prefix in micro-batches of up to 4
    assert (sorted(i for indices, _ in shared for i in indices) == list(range(40, 46))
            and {p for _, p in shared} == {300})
    unbounded = plan_micro_batches(rows, micro_batch=4, min_shared=0, max_tokens=0)
    assert max(positions(indices, p) for indices, p in unbounded) > 700  # the budget is what kept them small


def test_collate_refuses_a_prefix_the_rows_do_not_share():
    with pytest.raises(ValueError, match="same 3 tokens"):
        collate([row([1, 2, 3, 4], [5], "a"), row([1, 2, 9, 4], [5], "b")], 0, prefix_len=3)
    with pytest.raises(ValueError, match="longer"):
        collate([row([1, 2, 3], [5], "a"), row([1, 2, 3, 4], [5], "b")], 0, prefix_len=3)


@pytest.fixture(scope="module")
def lora_model():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_otel.serve.model import bundled_model_dir

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(bundled_model_dir(), dtype=torch.float32)
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0,
                                             task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)  # B starts at zero: perturb it, so the adapters change the outputs
    return model.train()


def group_rows(seed: int) -> list[dict]:
    """Two tasks' groups: samples of one task share its prompt; the turns of task A's second call extend it."""
    rng = random.Random(seed)

    def tokens(n):
        return [rng.randrange(200, 20000) for _ in range(n)]

    prompt_a, prompt_b = tokens(60), tokens(45)
    rows = []
    for k in range(3):
        rows.append(row(prompt_a, tokens(rng.randrange(3, 12)), f"a{k}", rng.uniform(-1, 1)))
        rows.append(row(prompt_b, tokens(rng.randrange(3, 12)), f"b{k}", rng.uniform(-1, 1)))
    rows.append(row(prompt_a + tokens(7), tokens(5), "a0", 0.3))  # a second turn of rollout a0
    for r in rows:
        r["completion_logprobs"] = [rng.uniform(-6, -0.5) for _ in r["completion_ids"]]
    return rows


def step_loss(model, rows, plans, kl):
    index: dict[str, int] = {}
    full = collate(rows, 0, index)
    scale = AGGREGATIONS["rollout"](full.mask.sum(dim=1), full.rollout)
    total = 0.0
    for indices, prefix_len in plans:
        batch = collate([rows[j] for j in indices], 0, index, prefix_len)
        logp = completion_logprobs(model, batch)
        ref = None
        if kl:
            with torch.no_grad(), model.disable_adapter():
                ref = completion_logprobs(model, batch)
        old = torch.where(torch.isnan(batch.old_logp), logp.detach(), batch.old_logp)  # padding, as optimize() does
        out = grpo_loss(logp, old, batch.advantages, token_weights(batch.mask, scale[indices]),
                        clip=0.2, kl_coef=kl, ref_logp=ref)
        out.loss.backward()
        total += float(out.loss.detach())
    return total


def gradients(model) -> torch.Tensor:
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
    model.zero_grad(set_to_none=True)
    return grads


def test_shared_prefix_gives_the_same_logprobs_as_padded_sequences(lora_model):
    rows = group_rows(1)
    members = [r for r in rows if r["prompt_ids"] == rows[0]["prompt_ids"]]
    with torch.no_grad():
        padded = completion_logprobs(lora_model, collate(members, 0))
        shared_batch = collate(members, 0, prefix_len=len(members[0]["prompt_ids"]) - 1)
        shared = completion_logprobs(lora_model, shared_batch)
    mask = shared_batch.mask.bool()
    assert shared_batch.prefix_ids.shape == (1, 59)
    assert torch.allclose(padded[mask], shared[mask], atol=2e-4), (padded[mask] - shared[mask]).abs().max()


@pytest.mark.heavy
@pytest.mark.parametrize("kl", [0.0, 0.04])
def test_shared_prefix_step_gives_the_same_loss_and_gradients(lora_model, kl):
    rows = group_rows(2)
    by_length = sorted(range(len(rows)), key=lambda i: len(rows[i]["prompt_ids"]) + len(rows[i]["completion_ids"]))
    plain = [(by_length[s:s + 4], 0) for s in range(0, len(rows), 4)]
    planned = plan_micro_batches(rows, micro_batch=4, min_shared=16)
    assert any(p >= 44 for _, p in planned)  # sharing did happen
    loss_plain = step_loss(lora_model, rows, plain, kl)
    g_plain = gradients(lora_model)
    loss_shared = step_loss(lora_model, rows, planned, kl)
    g_shared = gradients(lora_model)
    assert loss_shared == pytest.approx(loss_plain, abs=1e-5)
    assert float(g_plain.norm()) > 0
    assert float((g_plain - g_shared).norm() / g_plain.norm()) < 1e-3


def test_autocast_computes_in_bf16_close_to_fp32_and_trains_the_fp32_weights(lora_model):
    # Two sequences: on a CPU without bf16 instructions autocast runs in slow kernels (minutes for all seven).
    batch = collate(group_rows(3)[:2], 0)
    mask = batch.mask.bool()
    with torch.no_grad():
        exact = completion_logprobs(lora_model, batch)
    autocast = completion_logprobs(lora_model, batch, autocast=True)
    gap = (exact[mask] - autocast[mask].detach()).abs()
    assert autocast.dtype == torch.float32
    assert 0 < float(gap.max()) < 0.25, gap.max()  # bf16 rounding moves log-probs by hundredths, not more
    autocast[mask].sum().backward()
    grads = [p.grad for p in lora_model.parameters() if p.requires_grad]
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    assert float(gradients(lora_model).norm()) > 0
