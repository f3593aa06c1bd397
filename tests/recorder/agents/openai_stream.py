"""Plain openai SDK tool-calling agent, streaming (SSE) with usage in the last chunk."""
import json

from openai import OpenAI

from sql_tool import MODEL, OPENAI_TOOLS, QUESTION, SYSTEM, execute_sql


def main() -> None:
    client = OpenAI()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    for _ in range(4):
        stream = client.chat.completions.create(model=MODEL, messages=messages, tools=OPENAI_TOOLS,
                                                temperature=0.0, max_tokens=256, stream=True,
                                                stream_options={"include_usage": True})
        text, calls = [], {}
        for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            if delta.content:
                text.append(delta.content)
            for tc in delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    slot["id"] = tc.id
                if tc.function and tc.function.name:
                    slot["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    slot["arguments"] += tc.function.arguments
        if not calls:
            print("".join(text))
            return
        messages.append({"role": "assistant", "content": "".join(text) or None,
                         "tool_calls": [{"id": c["id"], "type": "function",
                                         "function": {"name": c["name"], "arguments": c["arguments"]}}
                                        for _, c in sorted(calls.items())]})
        for c in calls.values():
            messages.append({"role": "tool", "tool_call_id": c["id"],
                             "content": execute_sql(**json.loads(c["arguments"]))})
    raise SystemExit("no final answer")


if __name__ == "__main__":
    main()
