"""Learning runs: does training move what it should, from the bundled model or another small one?

    .venv/bin/python -m benchmarks.learning.<name> --help       # from the repository root

- spider_agent: held-out Spider accuracy of an example SQL agent before and after SFT, repair paths and GRPO;
- learning_check: GRPO on a reward and on its mirror, side by side (the loop moves the reward, only that way);
- math_agent: GRPO on the OpenAI Agents SDK calculator agent, scored on held-out problems;
- spider_synth, spider_rename, spider_repair: the Spider training data they use, written as task files;
- gemma_model: Gemma 3 270M as a local model folder for --model; grpo_knobs: the flags the runs share.

The reference without an agent is benchmarks/peers/plain_sft.py; results are in benchmarks/RESULTS.md.
"""
