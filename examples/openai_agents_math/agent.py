"""A calculator-tool math agent written with the OpenAI Agents SDK (openai-agents), as its users write one.

It knows nothing of lightning-otel: the SDK's own OpenTelemetry instrumentation
(opentelemetry-instrumentation-openai-agents) and the OpenAI one trace it under `opentelemetry-instrument`.

    # on its own, against any OpenAI-compatible endpoint:
    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 python agent.py --question "..." --model my-model
    # trained in process: lightning-otel train --agent examples/openai_agents_math/agent.py:run ...

The agent uses the SDK's default model provider (the Responses API, on OPENAI_BASE_URL and OPENAI_API_KEY),
offers one tool, `calculate(expression)`, and answers with its final message; the reward reads the last
number in it.
"""
from __future__ import annotations

import argparse
import ast
import asyncio
import operator
import os

from agents import Agent, ModelSettings, MultiProvider, RunConfig, Runner, function_tool
from agents.exceptions import AgentsException
from openai import AsyncOpenAI

# A worked example in the tool-call syntax the gateway teaches models without their own (Hermes): a model as
# small as the bundled 135M one rarely fills the arguments in without it.
INSTRUCTIONS = ('You solve math word problems with the calculate tool. Example: for "Sam has 12 bags of 4 apples '
                'and 7 more apples. How many apples does Sam have?" you call\n<tool_call>\n{"name": "calculate", '
                '"arguments": {"expression": "12 * 4 + 7"}}\n</tool_call>\nand when the tool answers 55, you reply: 55')
TOOL_CHOICE = "required"  # the first answer is a tool call; the SDK resets it to "auto" after the call
MAX_TURNS = 3
MAX_TOKENS = 64

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate(expression: str) -> float:
    """+ - * / // % and parentheses over numbers; anything else is a ValueError (no eval of model text)."""
    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Mult) and abs(left) * abs(right) > 1e15:
                raise ValueError("number too large")
            return _OPERATORS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](walk(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")
    try:
        return walk(ast.parse(expression.replace("x", "*").replace("×", "*"), mode="eval"))
    except (SyntaxError, ZeroDivisionError) as exc:
        raise ValueError(str(exc)) from None


@function_tool
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression such as "12 * 4 + 7" and return its value.

    Args:
        expression: numbers with + - * / and parentheses.
    """
    try:
        value = evaluate(expression)
    except ValueError as exc:
        return f"error: {exc}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def make_agent(model: str) -> Agent:
    return Agent(name="calculator", instructions=INSTRUCTIONS, tools=[calculate], model=model,
                 model_settings=ModelSettings(max_tokens=MAX_TOKENS, tool_choice=TOOL_CHOICE))


async def solve(model: str, question: str, run_config: RunConfig | None = None) -> str:
    """The agent's run; `run_config` None is the SDK's default (its provider reads OPENAI_BASE_URL)."""
    try:
        result = await Runner.run(make_agent(model), question, max_turns=MAX_TURNS, run_config=run_config)
    except AgentsException as exc:  # MaxTurnsExceeded; ModelBehaviorError for a reply cut at MAX_TOKENS (the
        # Responses API calls it incomplete): the episode ends without an answer
        return f"no answer: {type(exc).__name__}"
    return " ".join(str(result.final_output).split())  # one line: the answer is what the reply says, all of it


def run(task: dict, llm) -> str:
    """Entry point for lightning-otel's in-process mode: `llm` has base_url, api_key and model. Many rollouts
    share the process, each with its own base URL: the default provider gets this rollout's client."""
    async def go() -> str:
        async with AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key) as client:
            config = RunConfig(model_provider=MultiProvider(openai_client=client))
            return await solve(llm.model, task["question"], config)
    return asyncio.run(go())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--question", required=True)
    parser.add_argument("--model", default=os.environ.get("LIGHTNING_MODEL", "gpt-4o-mini"))
    args = parser.parse_args()
    print(asyncio.run(solve(args.model, args.question)))


if __name__ == "__main__":
    main()
