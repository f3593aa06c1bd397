"""Plain openai SDK tool-calling agent, non-streaming."""
import json

from openai import OpenAI

from sql_tool import MODEL, OPENAI_TOOLS, QUESTION, SYSTEM, execute_sql


def main() -> None:
    client = OpenAI()  # OPENAI_BASE_URL / OPENAI_API_KEY from the environment
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    for _ in range(4):
        resp = client.chat.completions.create(model=MODEL, messages=messages, tools=OPENAI_TOOLS,
                                              temperature=0.0, max_tokens=256)
        msg = resp.choices[0].message
        if not msg.tool_calls:
            print(msg.content)
            return
        messages.append({"role": "assistant", "content": msg.content,
                         "tool_calls": [tc.model_dump() for tc in msg.tool_calls]})
        for tc in msg.tool_calls:
            args = json.loads(tc.function.arguments)
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": execute_sql(**args)})
    raise SystemExit("no final answer")


if __name__ == "__main__":
    main()
