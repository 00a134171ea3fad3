"""Extractive question answering: SQuAD-format data, the built-in WordNet QA set, and
features over long contexts.

An example is a question, a context passage and its gold answers (texts, each with its
character start in the context). Sources:

- SQuAD-format JSON (``data/*/paragraphs/*/qas``; v2's unanswerable questions, with no
  answers, are left out and counted in the log);
- a Hugging Face dataset with SQuAD's columns (``question``, ``context``,
  ``answers: {text, answer_start}``);
- built in, from WordNet 3.0's glosses (no QA corpus installs offline): for each synset
  with a usage example that contains one of its words, the question asks which word of
  the passage has the synset's definition, the answer is that word in the example, and
  the passage is the example among ``DISTRACTORS`` usage examples of other synsets, in
  a seeded order. The lexicographer category is the example's class.

Long contexts are cut into windows (features) of at most ``max_length`` tokens that
overlap by ``stride`` tokens, each with the question first. A feature's answer is the
token span of the gold answer when the whole answer lies in its window, else the first
token alone ("not in this window"). Labels are per token, so that features batch like
any other token-labelled rows: ``START`` on the span's first token, ``END`` on its last
(``START + END`` on a one-token span), 0 on other tokens, the ignore label on padding.
Each feature keeps its example's index and the character offsets of its context tokens
(``-1`` outside the context), from which a predicted span becomes text.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import torch

from fedpeft.data.tables import utf8_line
from fedpeft.data.task import IGNORE, Encoded
from fedpeft.data.types import DataError

log = logging.getLogger(__name__)

DISTRACTORS = 5  # other synsets' usage examples around the one that holds the answer
START, END = 1, 2  # token labels of an answer span's first and last token


def read_squad(path: Path) -> dict[str, list]:
    """A SQuAD-format JSON file as columns ``question``, ``context``, ``answers``
    (texts), ``answer_starts`` and ``title``; errors name the file and the question."""
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        for lineno, line in enumerate(raw.splitlines(keepends=True), 1):
            utf8_line(line, path, lineno)  # a DataError naming the first line that is not UTF-8
        raise
    try:
        data = json.loads(text)["data"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise DataError(f"{path}: not SQuAD-format JSON (a 'data' list of articles): {err}") from None
    out: dict[str, list] = {"question": [], "context": [], "answers": [], "answer_starts": [], "title": []}
    unanswerable = 0
    for a, article in enumerate(data):
        for p, paragraph in enumerate(article.get("paragraphs", [])):
            context = paragraph.get("context")
            for q, qa in enumerate(paragraph.get("qas", [])):
                where = f"{path}: data[{a}].paragraphs[{p}].qas[{q}]"
                if not isinstance(context, str) or not isinstance(qa.get("question"), str):
                    raise DataError(f"{where}: needs a question and its paragraph's context (text)")
                answers = qa.get("answers") or []
                if not answers:
                    unanswerable += 1
                    continue
                for k, ans in enumerate(answers):
                    start, text = ans.get("answer_start"), ans.get("text")
                    if (
                        not isinstance(start, int)
                        or not isinstance(text, str)
                        or context[start : start + len(text)] != text
                    ):
                        raise DataError(
                            f"{where}: answer {k} {text!r} is not at character {start} of the context"
                        )
                out["question"].append(qa["question"])
                out["context"].append(context)
                out["answers"].append([x["text"] for x in answers])
                out["answer_starts"].append([x["answer_start"] for x in answers])
                out["title"].append(article.get("title", ""))
    if unanswerable:
        log.warning("%s: %d questions without an answer (SQuAD v2) left out", path, unanswerable)
    return out


def squad_columns(table: dict[str, list], origin: str) -> dict[str, list]:
    """A hub dataset's SQuAD columns (``answers: {text, answer_start}``) in the form of
    :func:`read_squad`."""
    for col in ("question", "context", "answers"):
        if col not in table:
            raise DataError(f"{origin}: no column {col!r} (SQuAD columns: question, context, answers)")
    keep = [i for i, a in enumerate(table["answers"]) if a and a.get("text")]
    return {
        "question": [table["question"][i] for i in keep],
        "context": [table["context"][i] for i in keep],
        "answers": [list(table["answers"][i]["text"]) for i in keep],
        "answer_starts": [list(table["answers"][i]["answer_start"]) for i in keep],
        "title": [table.get("title", [""] * len(table["question"]))[i] for i in keep],
    }


def wordnet_qa(glosses: dict[str, list], seed: int = 0) -> dict[str, list]:
    """The built-in QA set (see the module docstring) from :func:`read_glosses` columns."""
    rng = np.random.default_rng(seed)
    pool = [e for examples in glosses["examples"] for e in examples]
    out: dict[str, list] = {"question": [], "context": [], "answers": [], "answer_starts": [], "label": []}
    for definition, words, examples, lexname in zip(
        glosses["text"], glosses["words"], glosses["examples"], glosses["label"], strict=True
    ):
        found = _word_in(words, examples)
        if found is None:
            continue
        sentence, start, end = found
        others = [pool[i] for i in rng.choice(len(pool), size=DISTRACTORS, replace=False)]
        at = int(rng.integers(0, DISTRACTORS + 1))
        before = " ".join(s.rstrip(".") + "." for s in others[:at])
        offset = len(before) + 1 if before else 0
        context = " ".join(s.rstrip(".") + "." for s in [*others[:at], sentence, *others[at:]])
        out["question"].append(f'Which word or phrase in the passage means "{definition}"?')
        out["context"].append(context)
        out["answers"].append([sentence[start:end]])
        out["answer_starts"].append([offset + start])
        out["label"].append(lexname)
    return out


def _word_in(words: list[str], examples: list[str]) -> tuple[str, int, int] | None:
    """The first usage example containing one of ``words`` as a whole word (any case):
    ``(example, start, end)``."""
    for example in examples:
        for word in words:
            match = re.search(rf"(?<!\w){re.escape(word)}(?!\w)", example, flags=re.IGNORECASE)
            if match:
                return example, match.start(), match.end()
    return None


def encode_qa(
    questions: list[str],
    contexts: list[str],
    answer_starts: list[int],
    answer_texts: list[str],
    tokenizer,
    max_length: int,
    stride: int,
    first_id: int = 0,
) -> Encoded:
    """Features of every example (see the module docstring); the example index of
    feature ``f`` is ``first_id`` plus its row in the inputs. The label is the first gold
    answer's token span. A question longer than a third of ``max_length`` tokens is cut
    to that (logged), so every window keeps room for more context than the stride."""
    limit = max_length // 3
    room = max_length - limit - tokenizer.num_special_tokens_to_add(pair=True)
    if stride >= room:
        raise DataError(f"data.stride {stride}: windows of {max_length} tokens leave {room} for the context "
                        "with this tokenizer; lower data.stride or raise data.max_length")  # fmt: skip
    question_ids = tokenizer(list(questions), add_special_tokens=False)["input_ids"]
    long = [i for i, q in enumerate(question_ids) if len(q) > limit]
    if long:
        log.warning("%d of %d questions cut to %d tokens (a third of data.max_length)",
                    len(long), len(questions), limit)  # fmt: skip
        questions = list(questions)
        for i in long:
            questions[i] = tokenizer.decode(question_ids[i][:limit])
    enc = tokenizer(
        questions, contexts, truncation="only_second", max_length=max_length, stride=stride,
        return_overflowing_tokens=True, return_offsets_mapping=True,
    )  # fmt: skip
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rows, origin = enc["input_ids"], enc["overflow_to_sample_mapping"]
    width = max((len(r) for r in rows), default=1)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    offsets = torch.full((len(rows), width, 2), -1, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for f, row in enumerate(rows):
        ids[f, : len(row)] = torch.tensor(row, dtype=torch.long)
        labels[f, : len(row)] = 0
        example = origin[f]
        start_char = answer_starts[example]
        end_char = start_char + len(answer_texts[example])
        sequence = enc.sequence_ids(f)
        for t, (a, b) in enumerate(enc["offset_mapping"][f]):
            if sequence[t] == 1:
                offsets[f, t] = torch.tensor([a, b])
        context = [t for t, s in enumerate(sequence) if s == 1]
        start = end = 0  # not in this window
        if context and offsets[f, context[0], 0] <= start_char and offsets[f, context[-1], 1] >= end_char:
            start = next(t for t in context if offsets[f, t, 1] > start_char)
            end = next(t for t in reversed(context) if offsets[f, t, 0] < end_char)
        labels[f, start] += START
        labels[f, end] += END
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    example_ids = torch.tensor([first_id + e for e in origin], dtype=torch.long)
    return Encoded(ids, lengths, labels, aux={"example_ids": example_ids, "offsets": offsets})
