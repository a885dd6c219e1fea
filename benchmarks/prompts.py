"""The prompts every speed benchmark uses, so our engine and llama.cpp see the same tokens.

The text is the English prose of tests/data/perplexity.txt: ordinary sentences,
tokenized the way real requests are. A benchmark tokenizes with one tokenizer and
hands the same ids to both engines (their tokenizers agree on this text anyway).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

MODELS = ("smollm2:135m-instruct-q4_1", "gemma3:270m-q4_k_m")  # the two real models we compare on

TEXT = (Path(__file__).parent.parent / "tests" / "data" / "perplexity.txt").read_text(encoding="utf-8")
PARAGRAPHS = [p.strip() for p in TEXT.split("\n\n") if p.strip()]

N_PREFILL = 512  # tokens of the prefill prompt
N_DECODE = 128  # tokens generated in the decode measurement
SHORT_QUESTION = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def prefill_ids(tokenize: Callable[[str], list[int]], n: int = N_PREFILL) -> list[int]:
    """The first `n` token ids of the text (with BOS if the tokenizer adds it), repeated if too short."""
    text = TEXT
    while len(ids := tokenize(text)) < n:
        text += "\n\n" + TEXT
    return ids[:n]


def conversation(n_rounds: int = 5) -> list[dict]:
    """A multi-turn chat of about 1,000 tokens that ends with a user turn.

    Each round quotes one paragraph of the text and answers with the next, so the
    conversation reads like someone discussing a story with an assistant.
    """
    messages = [{"role": "system", "content": "You are a helpful assistant who discusses stories."}]
    for i in range(n_rounds):
        quote = PARAGRAPHS[(2 * i) % len(PARAGRAPHS)]
        answer = PARAGRAPHS[(2 * i + 1) % len(PARAGRAPHS)]
        messages.append({"role": "user", "content": f"What happens next after this part?\n\n{quote}"})
        messages.append({"role": "assistant", "content": answer})
    messages.append({"role": "user", "content": "Summarize the story so far in two sentences."})
    return messages


def next_turn(messages: list[dict], reply: str) -> list[dict]:
    """The conversation one round later: the assistant's reply, then a new user question."""
    return messages + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And who is the most interesting character, and why?"},
    ]


def model_path(name: str) -> Path:
    """The GGUF file of a model name, fetched into the model store if it is not there yet;
    a path to a GGUF file is that file."""
    from lmsp_min import fetch

    return Path(name) if Path(name).is_file() else fetch.pull(name)
