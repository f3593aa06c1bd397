"""Other projects measured on our workloads (README.md here says how each was set up and run); plain_sft is the
reference of the learning runs without an agent (python -m benchmarks.peers.plain_sft)."""
