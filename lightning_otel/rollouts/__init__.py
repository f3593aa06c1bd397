"""Floor 3, rollouts: tasks, the agent's environment, the runner that starts an unchanged agent per task
and sample (or calls an agent function in-process), and the reward registry. Task packs sit beside this
floor in `lightning_otel.tasks`.
"""
