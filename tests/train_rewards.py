"""A reward for the trainer tests that varies within every group of samples, so GRPO's gradient is not 0:
half for writing a SELECT at all, half for brevity (fewer words score higher)."""


def concise_sql(task: dict, rollout: dict) -> float:
    output = rollout.get("final_output") or ""
    return 0.5 * ("select" in output.lower()) + 0.5 / (1.0 + len(output.split()) / 10.0)
