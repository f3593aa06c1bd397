"""The prompt optimiser (`lightning-otel optimize`): instructions and demonstrations for an unchanged agent, found
by rollouts through the gateway under prompt patches (lightning_otel.serve.prompts); see optimizer.py."""
