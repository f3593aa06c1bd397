"""Plain single-turn SFT: the reference the learning benchmark (benchmarks/learning/spider_agent.py) has to beat.

    .venv/bin/python -m benchmarks.peers.plain_sft --out /tmp/plain-sft [--sft-tasks 420] [--epochs 1] [--lr 5e-5]

No agent, no gateway, no trace store, no DeepSpeed: transformers and a torch AdamW loop on the bundled
SmolLM2-135M. Each labelled question becomes one chat, the exact first call of examples/sql_agent (its system
prompt with its schema text, the question as the user turn) answered with the gold query in a ```sql``` block.
Then greedy decoding (96 new tokens) of the same first call on the held-out questions, scored with the
project's `spider_exec` on the answer's SQL. The split is the learning benchmark's (the Spider pack's
`splits.split()`): the same held-out databases and questions, the same SFT questions for the same
`--sft-tasks`. It also scores a sample of the training questions, which tells fitting apart from generalizing.

Full fine-tune by default (`--lora R` for a LoRA adapter on every linear layer); `--autocast` runs forward and
backward under bf16 autocast (fp32 weights and AdamW; about 1.6x faster on a CPU with AVX512-BF16).
`--renamed N` adds N of the SFT questions asked on renamed copies of their databases
(lightning_otel.tasks.spider.renaming), so names have to be read from the schema in the prompt.
`--link` makes every target copy the schema lines of the tables its query names before the query (schema
linking as the answer's first step, `spider_agent.with_links`); the agent's `extract_sql` still reads the query.
Writes `plain_sft.json` (arguments, losses, accuracy with its 95% Wilson interval, every answer) into --out.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers.examples import example_module
from benchmarks.learning.spider_agent import DEMONSTRATIONS, with_links
from lightning_otel.eval.metrics import wilson_interval
from lightning_otel.serve.engine import default_engine_python
from lightning_otel.serve.model import resolve_model
from lightning_otel.tasks.spider.linking import LINKED_LABEL, LINKED_MAX_TOKENS, SQL_LABEL
from lightning_otel.tasks.spider.renaming import with_renamed
from lightning_otel.tasks.spider.rewards import bundled_data_dir, database_path, spider_exec
from lightning_otel.tasks.spider.splits import read_rows, split
from lightning_otel.tasks.spider.synthesis import ID_PREFIX

SQL_AGENT = example_module("sql_agent")  # the example agent's own prompts and parser
CHECK, WRITE, extract_sql, read_schema = SQL_AGENT.CHECK, SQL_AGENT.WRITE, SQL_AGENT.extract_sql, SQL_AGENT.read_schema
review_request, run_sql = SQL_AGENT.review_request, SQL_AGENT.run_sql

REVIEW_LABEL = DEMONSTRATIONS["sql_agent"][1]  # the reviewer's answer on a gold query


class Prompts:
    """The sql_agent's calls for a question as chat text or prompt token ids (schemas read once per database):
    its first call (write the query) and, with `review=True`, its reviewer's call on the row's gold query."""

    def __init__(self, tokenizer, data: Path) -> None:
        self.tokenizer, self.data, self.schemas = tokenizer, data, {}

    def messages(self, row: dict, review: bool = False) -> list[dict]:
        db_id = row["db_id"]
        if db_id not in self.schemas:
            self.schemas[db_id] = read_schema(str(database_path(self.data, db_id)))
        if review:  # the query as the agent passes it on (extract_sql's one line) and what SQLite returns for it
            sql = extract_sql(row["query"])
            system, user = CHECK, review_request(row["question"], sql, run_sql(str(database_path(self.data, db_id)),
                                                                               sql))
        else:
            system, user = WRITE, row["question"]
        return [{"role": "system", "content": system.format(schema=self.schemas[db_id])},
                {"role": "user", "content": user}]

    def text(self, row: dict, review: bool = False) -> str:
        return self.tokenizer.apply_chat_template(self.messages(row, review), tokenize=False,
                                                  add_generation_prompt=True)

    def ids(self, row: dict, review: bool = False) -> list[int]:
        return self.tokenizer.encode(self.text(row, review), add_special_tokens=False)


def micro_batch_loss(model, pairs: list[tuple[list[int], list[int]]], pad_id: int, autocast: bool) -> torch.Tensor:
    """Summed cross-entropy of the completions. Left-padded, so every completion ends at the last position and
    logits are computed for the last (longest completion + 1) positions only: over a whole batch a 262k-token
    vocabulary (Gemma 3) needs tens of GB for them."""
    length = max(len(p) + len(c) for p, c in pairs)
    keep = max(len(c) for _, c in pairs) + 1
    ids = torch.full((len(pairs), length), pad_id)          # [B, L]
    mask = torch.zeros((len(pairs), length), dtype=torch.long)
    labels = torch.full((len(pairs), keep - 1), -100)      # [B, K-1]: the tokens at positions L-K+1 .. L-1
    for i, (prompt, completion) in enumerate(pairs):
        tokens = prompt + completion
        ids[i, length - len(tokens):] = torch.tensor(tokens)
        mask[i, length - len(tokens):] = 1
        labels[i, keep - 1 - len(completion):] = torch.tensor(completion)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)         # each sequence counts from 0 at its first token
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                       logits_to_keep=keep).logits[:, :-1].float()  # [B, K-1, V]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                                             ignore_index=-100, reduction="sum")


def fine_tune(model, examples: list[tuple[list[int], list[int]]], args, pad_id: int) -> list[float]:
    """AdamW at a constant rate, `args.batch` examples a step (micro-batches of `args.micro_batch`), gradient norm
    clipped at 1."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    steps = int(len(examples) * args.epochs / args.batch)
    rng = random.Random(args.seed)
    order: list[int] = []
    while len(order) < steps * args.batch:
        epoch = list(range(len(examples)))
        rng.shuffle(epoch)
        order += epoch
    losses, began = [], time.perf_counter()
    model.train()
    for step in range(steps):
        batch = sorted((examples[i] for i in order[step * args.batch:(step + 1) * args.batch]),
                       key=lambda pair: len(pair[0]) + len(pair[1]))  # similar lengths share a micro-batch
        tokens = sum(len(c) for _, c in batch)
        total = 0.0
        for start in range(0, len(batch), args.micro_batch):
            loss = micro_batch_loss(model, batch[start:start + args.micro_batch], pad_id, args.autocast) / tokens
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
        if step % 10 == 0 or step == steps - 1:
            print(f"step {step + 1}/{steps} loss {total:.3f} ({time.perf_counter() - began:.0f} s)", flush=True)
    return losses


def save(model, tokenizer, folder: Path) -> None:
    """The model as a plain Hugging Face folder (a LoRA adapter merged in), with the tokenizer and its chat
    template, which vLLM serves and the learner loads like any other model folder."""
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@torch.no_grad()
def answer(model, tokenizer, prompts: Prompts, rows: list[dict], label: str, max_new_tokens: int = 96) -> dict:
    """Greedy first answers of `rows`, scored against their gold queries."""
    model.eval()
    tokenizer.padding_side = "left"
    answers = []
    for start in range(0, len(rows), 16):
        chunk = rows[start:start + 16]
        encoded = tokenizer([prompts.text(r) for r in chunk], return_tensors="pt", padding=True,
                            add_special_tokens=False)
        generated = model.generate(**encoded, max_new_tokens=max_new_tokens, do_sample=False,
                                   pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        for row, ids in zip(chunk, generated[:, encoded["input_ids"].shape[1]:]):
            sql = extract_sql(tokenizer.decode(ids, skip_special_tokens=True))
            answers.append({"id": row["id"], "question": row["question"], "gold": row["query"], "answer": sql,
                            "correct": bool(spider_exec(row, {"final_output": sql}))})
    correct = sum(a["correct"] for a in answers)
    interval = wilson_interval(correct, len(answers))
    print(f"{label}: {correct}/{len(answers)} = {100 * correct / len(answers):.1f}% "
          f"(95% CI {100 * interval[0]:.1f}-{100 * interval[1]:.1f}%)", flush=True)
    return {"correct": correct, "n": len(answers), "interval": interval, "answers": answers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sft-tasks", type=int, help="as spider_agent (default: all, ~1,470)")
    parser.add_argument("--synthetic", type=int, default=0, help="as spider_agent: templated questions "
                        "per training dev database added to the SFT set")
    parser.add_argument("--renamed", type=int, default=0, help="as spider_agent: this many SFT questions "
                        "asked again on renamed copies of their databases (lightning_otel.tasks.spider.renaming)")
    parser.add_argument("--eval-tasks", type=int, default=150)
    parser.add_argument("--train-sample", type=int, default=40, help="training questions scored after SFT")
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=8, help="examples in one forward pass (memory: 4 for "
                        "Gemma 3's 262k-token vocabulary with --link)")
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tune)")
    parser.add_argument("--autocast", action="store_true", help="bf16 autocast for forward and backward")
    parser.add_argument("--model", help="a local Hugging Face model folder with a chat template (default: the "
                        "bundled SmolLM2-135M)")
    parser.add_argument("--link", action="store_true", help="targets copy the schema lines of the tables the gold "
                        f"query names before the query (spider_agent.with_links); answers get {LINKED_MAX_TOKENS} "
                        "tokens")
    parser.add_argument("--review", type=int, default=0, help="also train the agent's reviewer call on this many "
                        "SFT questions (spread evenly): their gold query and its result, answered THE QUERY IS "
                        "CORRECT, as benchmarks.learning.spider_agent's SFT demonstrates it")
    parser.add_argument("--save", type=Path, help="save the fine-tuned model (LoRA merged in) with its tokenizer "
                        "here: a model folder benchmarks.learning.spider_agent --model DIR --from-sft starts the agent "
                        "from")
    parser.add_argument("--no-answers", action="store_true", help="skip scoring the greedy answers (e.g. when the "
                        "saved model is evaluated through the agent instead)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.save and args.save.resolve() == args.out.resolve():
        parser.error("--save needs a folder of its own, not --out")
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    files = split(args.out, args.eval_tasks, 0, args.sft_tasks, args.synthetic)
    sft_rows, held_out = read_rows(files["sft"]), read_rows(files["eval"])
    labelled = [r for r in sft_rows if not str(r["id"]).startswith(ID_PREFIX)]  # scored: Spider's own questions
    train_sample = labelled[::max(1, len(labelled) // args.train_sample)][:args.train_sample]
    data = bundled_data_dir()
    if args.renamed:  # prompts read every schema from out/data (the bundled databases and the renamed copies)
        sft_rows = with_renamed(sft_rows, data, args.out / "data", args.renamed)
        data = args.out / "data"

    model_dir = resolve_model(args.model, default_engine_python())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules="all-linear",
                                                 lora_dropout=0.0))
    prompts = Prompts(tokenizer, data)
    if args.link:
        sft_rows = with_links(sft_rows, data)
    label = LINKED_LABEL if args.link else SQL_LABEL
    examples = [(prompts.ids(r), tokenizer.encode(label.format(**r), add_special_tokens=False)
                 + [tokenizer.eos_token_id]) for r in sft_rows]
    if args.review:
        verdict = tokenizer.encode(REVIEW_LABEL, add_special_tokens=False) + [tokenizer.eos_token_id]
        reviewed = sft_rows[::max(1, len(sft_rows) // args.review)][:args.review]
        examples += [(prompts.ids(r, review=True), verdict) for r in reviewed]
    print(f"{len(examples)} examples, {sum(len(p) for p, _ in examples) / len(examples):.0f} prompt tokens on "
          f"average; {len(held_out)} held-out questions", flush=True)
    began = time.perf_counter()
    losses = fine_tune(model, examples, args, tokenizer.pad_token_id or tokenizer.eos_token_id)
    seconds = {"sft": time.perf_counter() - began}
    if args.save:
        save(model, tokenizer, args.save)
        print(f"saved the fine-tuned model in {args.save}", flush=True)
    scores = {}
    if not args.no_answers:
        began = time.perf_counter()
        budget = LINKED_MAX_TOKENS if args.link else 96
        scores = {"training_sample": answer(model, tokenizer, prompts, train_sample, "training questions", budget),
                  "held_out": answer(model, tokenizer, prompts, held_out, "held-out questions", budget)}
        seconds["answers"] = time.perf_counter() - began
    (args.out / "plain_sft.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "losses": losses, "seconds": seconds, **scores},
        indent=1))


if __name__ == "__main__":
    main()
