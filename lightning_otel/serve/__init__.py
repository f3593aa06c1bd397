"""Floor 2, serving the policy: the vLLM engine, the OpenAI-compatible rollout gateway in front of it
(token ids, logprobs, policy version per call), request checks, tool-call parsing, model resolution and
policy loading. Imports the capture floor and the span store, nothing above.
"""
