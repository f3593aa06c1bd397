"""From stored spans to training transitions, torch-free: trajectories (each rollout's LLM calls in order with
their token records), hierarchical credit (returns and advantages), re-tokenisation of calls without a token
record, and compile, which puts them together. Training (train/) consumes what this produces.
"""
