"""Instruction-tuning data: prompts as chat messages, responses, and their tokenisation.

An example is a prompt (a list of chat messages, ``{"role", "content"}``) and the
response the model should give. Sources:

- Alpaca-style JSONL: ``instruction``, optional ``input``, ``output`` per line;
- chat JSONL: ``messages`` per line, the last one the assistant's (the response; read
  by :func:`fedpeft.data.tables.read_jsonl_messages`);
- WordNet definition generation (built in): the prompt asks for the definition of a
  lemma with its part of speech, the response is the synset's gloss, and the synset's
  lexicographer category is the example's domain (a client's natural partition).

Tokenisation applies the tokenizer's chat template to the prompt (with the generation
prompt, so the model's turn has begun) and appends the response and the end-of-turn
token. Only response tokens carry labels: prompt and padding positions hold
:data:`IGNORE`, so the loss never sees the prompt.
"""

from __future__ import annotations

import logging

import torch

from fedpeft.data.tables import place
from fedpeft.data.task import IGNORE, Encoded
from fedpeft.data.types import DataError

log = logging.getLogger(__name__)

Messages = list[dict[str, str]]
ROLES = ("system", "user", "assistant")


def alpaca_prompt(instruction: str, context: str | None) -> Messages:
    """The user turn of an Alpaca-style example: the instruction, then its input if any."""
    text = instruction if not context else f"{instruction}\n\n{context}"
    return [{"role": "user", "content": text}]


def split_conversation(messages: object) -> tuple[Messages, str]:
    """A chat example's prompt (every message but the last) and response (the last,
    which must be the assistant's); a malformed one is a ValueError saying what is wrong."""
    if not isinstance(messages, list) or len(messages) < 2:
        raise ValueError("'messages' must be a list of at least two messages")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"message {k} needs a role ({', '.join(ROLES)}) and text content")
    if messages[-1]["role"] != "assistant":
        raise ValueError("the last message is the response and must be the assistant's")
    return [dict(role=m["role"], content=m["content"]) for m in messages[:-1]], messages[-1]["content"]


def instruction_columns(table: dict[str, list], origin: str) -> tuple[list[Messages], list[str]]:
    """Prompts and responses of a table in either format (chosen by its columns)."""
    prompts, responses = [], []
    if "messages" in table:
        for row, messages in enumerate(table["messages"]):
            try:
                prompt, response = split_conversation(messages)
            except ValueError as err:
                raise DataError(f"{place(origin, row)}: {err}") from None
            prompts.append(prompt)
            responses.append(response)
        return prompts, responses
    if "instruction" not in table or "output" not in table:
        raise DataError(
            f"{origin}: an instruction file needs columns instruction and output (Alpaca, with an "
            f"optional input) or messages (chat); it has {sorted(table)}"
        )
    contexts = table.get("input", [None] * len(table["instruction"]))
    for row, (instruction, context, output) in enumerate(
        zip(table["instruction"], contexts, table["output"], strict=True)
    ):
        if not isinstance(instruction, str) or not instruction.strip():
            raise DataError(f"{place(origin, row)}: column 'instruction' is empty or not text")
        if not isinstance(output, str) or not output.strip():
            raise DataError(f"{place(origin, row)}: column 'output' is empty or not text")
        prompts.append(alpaca_prompt(instruction, context if isinstance(context, str) else None))
        responses.append(output)
    return prompts, responses


def definition_prompt(lemma: str, pos: str) -> Messages:
    """WordNet definition generation: the question for one lemma."""
    article = "an" if pos[0] in "aeiou" else "a"
    word = {"adj": "adjective", "adv": "adverb"}.get(pos, pos)
    return [{"role": "user", "content": f'Define "{lemma}" as {article} {word}, in one line.'}]


# ---------------------------------------------------------------- tokenisation


def render_prompt(tokenizer, prompt: Messages, system_prompt: str | None) -> str:
    """The prompt as the model reads it: its chat template with the assistant's turn
    opened. ``system_prompt`` (when set and the prompt has none) goes first. A tokenizer
    without a template gets a plain ``role: text`` layout."""
    if system_prompt is not None and prompt[0]["role"] != "system":
        prompt = [{"role": "system", "content": system_prompt}, *prompt]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    return "".join(f"{m['role']}: {m['content']}\n" for m in prompt) + "assistant:"


def encode_instructions(
    prompts: list[Messages],
    responses: list[str],
    tokenizer,
    max_length: int,
    system_prompt: str | None = None,
    origin: str = "data",
) -> Encoded:
    """Tokenise prompt + response + end-of-turn, truncating the response to fit
    ``max_length``; labels are the response's token ids, :data:`IGNORE` elsewhere.

    An example whose prompt alone fills ``max_length`` keeps its place (the partition
    has counted it) but has nothing to learn from or be scored on: it gets no response
    tokens, so no loss or score counts it; how many is logged, and if none is left the
    data are refused."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    end = tokenizer.eos_token or ""
    rendered = [render_prompt(tokenizer, p, system_prompt) for p in prompts]
    prompt_ids = [p[:max_length] for p in tokenizer(rendered, add_special_tokens=False)["input_ids"]]
    response_ids = tokenizer([r + end for r in responses], add_special_tokens=False)["input_ids"]
    rows = [(p, r[: max_length - len(p)]) for p, r in zip(prompt_ids, response_ids, strict=True)]
    empty = sum(not r for _, r in rows)
    if rows and empty == len(rows):
        raise DataError(f"{origin}: every prompt is {max_length} tokens or longer; raise data.max_length")
    if empty:
        log.warning("%s: %d of %d examples have no room for a response within data.max_length=%d: "
                    "they count in no loss or score", origin, empty, len(rows), max_length)  # fmt: skip
    width = max((len(p) + len(r) for p, r in rows), default=1)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for k, (p, r) in enumerate(rows):
        ids[k, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
        labels[k, len(p) : len(p) + len(r)] = torch.tensor(r, dtype=torch.long)
    lengths = torch.tensor([len(p) + len(r) for p, r in rows], dtype=torch.long)
    prompt_lengths = torch.tensor([len(p) for p, _ in rows], dtype=torch.long)
    return Encoded(ids, lengths, labels, prompt_lengths)
