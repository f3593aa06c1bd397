"""Synthetic two-step arithmetic word problems for the calculator agent, train and test kept apart.

Train and test share no template and no number: train problems draw their numbers from 2-40 and use
TRAIN_TEMPLATES, test problems draw from 41-99 and use TEST_TEMPLATES. So a gain on test is a gain in using the
calculator on problems the policy never saw, not recall of answers.

    python examples/openai_agents_math/problems.py --split train --count 64 --seed 0 > train.jsonl

Each line: {"id" (the task id), "question", "answer" (an integer), "expression", "template", "split"}.
"""
from __future__ import annotations

import argparse
import json
import random
import sys

# (template id, text, expression over a, b, c). Every answer is a positive integer (subtractions are checked).
TRAIN_TEMPLATES = [
    ("apples", "{name} has {a} apples. She buys {b} more and then gives {c} to a friend. "
               "How many apples does she have now?", "{a} + {b} - {c}"),
    ("pencils", "A box holds {a} pencils. How many pencils are there in {b} boxes and {c} loose pencils?",
     "{a} * {b} + {c}"),
    ("pages", "{name} reads {a} pages a day for {b} days, and then {c} more pages. How many pages did {name} read?",
     "{a} * {b} + {c}"),
    ("farm", "A farmer has {a} cows and {b} sheep. He sells {c} animals. How many animals does he have left?",
     "{a} + {b} - {c}"),
    ("classes", "There are {a} students in each of {b} classes. {c} students are absent today. "
                "How many students are present?", "{a} * {b} - {c}"),
    ("wages", "{name} earns {a} dollars a week. After {b} weeks {name} spends {c} dollars. "
              "How many dollars are left?", "{a} * {b} - {c}"),
    ("shirts", "A shop had {a} shirts. It sold {b} of them and then received {c} more. "
               "How many shirts does the shop have?", "{a} - {b} + {c}"),
    ("marbles", "{name} had {a} marbles, won {b} more, and then won {c} more. How many marbles does {name} have?",
     "{a} + {b} + {c}"),
]
TEST_TEMPLATES = [
    ("library", "A library owns {a} books and buys {b} new books every month for {c} months. "
                "How many books does it own after that?", "{a} + {b} * {c}"),
    ("train", "A train carries {a} passengers. At the station {b} passengers get off and {c} get on. "
              "How many passengers are on the train now?", "{a} - {b} + {c}"),
    ("crates", "Each crate holds {a} bottles. A truck carries {b} crates, and {c} bottles break on the way. "
               "How many bottles are still whole?", "{a} * {b} - {c}"),
    ("coins", "{name} saved {a} coins in May and {b} coins in June, then spent {c} coins. "
              "How many coins are left?", "{a} + {b} - {c}"),
    ("garden", "A garden has {a} rows of {b} tulips and also {c} roses. How many flowers are in the garden?",
     "{a} * {b} + {c}"),
    ("running", "{name} ran {a} km on Monday, {b} km on Tuesday and {c} km on Wednesday. "
                "How many km did {name} run in all?", "{a} + {b} + {c}"),
    ("tickets", "A cinema sold {a} tickets on each of {b} days and gave away {c} free tickets. "
                "How many tickets were sold or given away?", "{a} * {b} + {c}"),
    ("flour", "A bakery had {a} bags of flour. It used {b} bags on Friday and {c} bags on Saturday. "
              "How many bags are left?", "{a} - {b} - {c}"),
]
# One operation each, in the test range: the easiest problems the tool can be used for (difficulty probes,
# benchmarks/math_difficulty.py); not used by training.
ONE_STEP_TEMPLATES = [
    ("shelves", "One shelf holds {a} books and another holds {b} books. How many books are there?", "{a} + {b}"),
    ("pens", "There are {a} boxes with {b} pens in each box. How many pens are there?", "{a} * {b}"),
    ("stamps", "{name} had {a} stamps and gave {b} of them away. How many stamps are left?", "{a} - {b}"),
]
NAMES = ["Ana", "Ben", "Chen", "Dina", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jia", "Kofi", "Lena"]
RANGES = {"train": (2, 40), "test": (41, 99)}


def make(split: str, count: int, seed: int = 0, steps: int = 2) -> list[dict]:
    """`count` problems of `split` ("train" or "test"), the same for the same seed. steps=1: one-operation
    problems (ONE_STEP_TEMPLATES) with the split's numbers."""
    if split not in RANGES:
        raise ValueError(f"split {split!r}: use 'train' or 'test'")
    if steps not in (1, 2):
        raise ValueError(f"steps {steps}: use 1 or 2")
    templates = ONE_STEP_TEMPLATES if steps == 1 else TRAIN_TEMPLATES if split == "train" else TEST_TEMPLATES
    low, high = RANGES[split]
    prefix = split if steps == 2 else f"{split}1"  # one-step problems never share an id with two-step ones
    rng = random.Random(f"{split}-{seed}")
    rows: list[dict] = []
    while len(rows) < count:
        template_id, text, expression = templates[len(rows) % len(templates)]
        numbers = {k: rng.randint(low, high) for k in "abc"}
        filled = expression.format(**numbers)
        answer = eval(filled, {"__builtins__": {}})  # our own template of integers and + - *
        if answer <= 0:
            continue
        rows.append({"id": f"{prefix}-{seed}-{len(rows):04d}",
                     "question": text.format(name=rng.choice(NAMES), **numbers),
                     "answer": answer, "expression": filled, "template": template_id, "split": split})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", choices=sorted(RANGES), required=True)
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, choices=(1, 2), default=2, help="operations per problem")
    args = parser.parse_args(argv)
    for row in make(args.split, args.count, args.seed, args.steps):
        sys.stdout.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
