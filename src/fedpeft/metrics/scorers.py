"""How an engine scores a model on a set of examples, per task; engines hold one scorer
and never look at what a task's scores are.

- :class:`ClassificationScorer`: accuracy, macro-F1, MCC of arg-max predictions; many
  clients' models are scored at once, their forward passes vmapped.
- :class:`TaggingScorer` (NER): entity-level precision, recall and F1 (seqeval, micro
  over entity types, IOB2) of the tags predicted at each word's first sub-word, and
  the accuracy over words.
- :class:`GenerationScorer` (causal LM): the mean negative log-likelihood per response
  token and its perplexity over every example, and generation scores
  (:mod:`fedpeft.metrics.generation`) of the responses generated for the first
  ``samples`` examples. Generation runs one client's model at a time.

Every scorer's score splits over ranks (``fedpeft.engines.distributed``): ``predictions(model,
data, part)`` is what part ``r`` of ``n`` of the work yields (classification's and NER's
rows, QA's features, generation's likelihood rows and generated batches), and
``from_predictions`` scores the parts, gathered in order, as one pass scores the whole.

Every scorer cuts its examples into consecutive batches of at most ``eval.batch_size``
rows and ``eval.batch_tokens`` tokens (:func:`fedpeft.data.task.eval_batches`): a test
set of long rows gets batches of fewer rows, so the defaults fit every task.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from fedpeft.data.task import IGNORE, WHOLE, Encoded, Part, eval_batches, make_batch, share_of
from fedpeft.engines.local import predict_cohort
from fedpeft.metrics.classification import predict, scores
from fedpeft.tensors import Tensors

Loader = Callable[[Tensors], None]


class Scorer(Protocol):
    def score(self, model: torch.nn.Module, data: Encoded) -> dict[str, float]:
        """The model, as loaded, on ``data``."""

    def predictions(self, model: torch.nn.Module, data: Encoded, part: Part = WHOLE):
        """What part ``part`` of scoring ``data`` yields (the model as loaded)."""

    def from_predictions(self, parts: list, data: Encoded) -> dict[str, float]:
        """The scores of ``data`` from every part's :meth:`predictions`, in order."""

    def score_clients(
        self, model: torch.nn.Module, states: list[Tensors], data: Encoded | list[Encoded], load: Loader
    ) -> list[dict[str, float]]:
        """Each client's model (``states[c]``; ``load`` puts a state into the model) on its
        own examples (``data[c]``) or all on the same ones."""


class ClassificationScorer:
    def __init__(self, batch_size: int, batch_tokens: int | None = None):
        self.batch_size, self.batch_tokens = batch_size, batch_tokens

    def score(self, model: torch.nn.Module, data: Encoded) -> dict[str, float]:
        """The model, as loaded, on ``data``."""
        return self.from_predictions([self.predictions(model, data)], data)

    def predictions(self, model: torch.nn.Module, data: Encoded, part: Part = WHOLE) -> np.ndarray:
        """The model's predictions of ``part`` of ``data``'s rows."""
        return predict(model, rows_in(data, part), self.batch_size, self.batch_tokens)

    def from_predictions(self, parts: list[np.ndarray], data: Encoded) -> dict[str, float]:
        """The scores of ``data`` from the predictions of its consecutive ``parts``."""
        return scores(np.concatenate(parts), data.labels.cpu().numpy())

    def score_clients(
        self, model: torch.nn.Module, states: list[Tensors], data: Encoded | list[Encoded], load: Loader
    ) -> list[dict[str, float]]:
        """Each client's model (``states[c]`` in place of the trainable tensors) on its own
        examples (``data[c]``) or all on the same ones."""
        preds = predict_cohort(model, states, data, self.batch_size, self.batch_tokens)
        sets = data if isinstance(data, list) else [data] * len(states)
        return [scores(p, d.labels.cpu().numpy()) for p, d in zip(preds, sets, strict=True)]


def rows_in(data: Encoded, part: Part) -> Encoded:
    """Part ``part`` of ``data``'s rows."""
    return data if part == WHOLE else data.subset(torch.arange(len(data))[share_of(len(data), part)])


class OneAtATime:
    """Scores clients' models one after another, each loaded into the model in turn."""

    def score(self, model: torch.nn.Module, data: Encoded) -> dict[str, float]:
        return self.from_predictions([self.predictions(model, data)], data)

    def predictions(self, model: torch.nn.Module, data: Encoded, part: Part = WHOLE):
        raise NotImplementedError

    def from_predictions(self, parts: list, data: Encoded) -> dict[str, float]:
        raise NotImplementedError

    def score_clients(
        self, model: torch.nn.Module, states: list[Tensors], data: Encoded | list[Encoded], load: Loader
    ) -> list[dict[str, float]]:
        sets = data if isinstance(data, list) else [data] * len(states)
        out = []
        for state, examples in zip(states, sets, strict=True):
            load(state)
            out.append(self.score(model, examples))
        return out


class GenerationScorer(OneAtATime):
    def __init__(self, tokenizer, options, batch_size: int, batch_tokens: int | None = None):
        self.tokenizer, self.options = tokenizer, options
        self.batch_size, self.batch_tokens = batch_size, batch_tokens

    def predictions(
        self, model: torch.nn.Module, data: Encoded, part: Part = WHOLE
    ) -> tuple[float, int, list[str]]:
        """Part ``part`` of ``data``: its rows' summed negative log-likelihood of the
        response tokens and their count, and the responses of its share of the batches
        generated for the shown examples (the first ``samples`` with a response). Sampled
        responses are all generated by part 0 (their random stream runs through the batches
        in order)."""
        from fedpeft.models.causal import generate, response_nll

        nll, count = response_nll(model, rows_in(data, part), self.batch_size, self.batch_tokens)
        if self.options.strategy == "sample" and part != WHOLE:
            if part[0] != 0:
                return nll, count, []
            part = WHOLE
        texts = generate(
            model, self.shown(data), self.tokenizer, self.options, self.batch_size, self.batch_tokens, part
        )
        return nll, count, texts

    def from_predictions(self, parts: list[tuple[float, int, list[str]]], data: Encoded) -> dict[str, float]:
        """The mean negative log-likelihood per response token of ``data`` and its
        perplexity, and the generation scores of the shown examples' responses."""
        from fedpeft.metrics.generation import generation_scores
        from fedpeft.models.causal import references_of

        nll, count = sum(p[0] for p in parts), sum(p[1] for p in parts)
        mean = nll / count if count else float("nan")
        predictions = [text for p in parts for text in p[2]]
        return {
            "nll": mean,
            "perplexity": math.exp(mean) if count else float("nan"),
            **generation_scores(predictions, references_of(self.shown(data), self.tokenizer)),
        }

    def shown(self, data: Encoded) -> Encoded:
        """The examples whose responses are generated: the first ``samples`` (0: all) with a response."""
        scored = torch.nonzero((data.labels != IGNORE).any(-1)).flatten().cpu()
        return data.subset(scored[: self.options.samples] if self.options.samples else scored)


class TaggingScorer(OneAtATime):
    def __init__(self, tag_names: list[str], batch_size: int, batch_tokens: int | None = None):
        self.tag_names, self.batch_size, self.batch_tokens = tag_names, batch_size, batch_tokens

    @torch.no_grad()
    def predictions(
        self, model: torch.nn.Module, data: Encoded, part: Part = WHOLE
    ) -> tuple[list[list[str]], list[list[str]]]:
        """Each row's (of part ``part`` of ``data``) predicted and gold tags at its words' first sub-words."""
        model.eval()
        data = rows_in(data, part)
        predicted, gold = [], []
        for rows in eval_batches(data.lengths, self.batch_size, self.batch_tokens):
            batch = make_batch(data, rows)
            tags = model(**batch).argmax(-1).cpu()
            labels = batch["labels"].cpu()
            for row_tags, row_labels in zip(tags, labels, strict=True):
                words = row_labels != IGNORE  # each word's first sub-word
                predicted.append([self.tag_names[t] for t in row_tags[words].tolist()])
                gold.append([self.tag_names[t] for t in row_labels[words].tolist()])
        return predicted, gold

    def from_predictions(self, parts: list[tuple[list, list]], data: Encoded) -> dict[str, float]:
        """The scores of ``data`` from the predictions of its consecutive ``parts``."""
        from fedpeft.metrics.tagging import tagging_scores

        return tagging_scores([p for part in parts for p in part[0]], [g for part in parts for g in part[1]])


class SpanScorer(OneAtATime):
    """Extractive QA: per example, the best span over all its features (start and end
    logits summed, the end at most ``max_answer_tokens`` tokens after the start, both in
    the context), its text cut from the context by the tokens' character offsets, then
    exact match and F1 against the gold answers (:mod:`fedpeft.metrics.qa`)."""

    def __init__(
        self,
        contexts: list[str],
        answers: list[list[str]],
        batch_size: int,
        max_answer_tokens: int,
        batch_tokens: int | None = None,
    ):
        self.contexts, self.answers = contexts, answers  # indexed by example id (pool, then test)
        self.batch_size, self.max_answer_tokens = batch_size, max_answer_tokens
        self.batch_tokens = batch_tokens

    @torch.no_grad()
    def predictions(
        self, model: torch.nn.Module, data: Encoded, part: Part = WHOLE
    ) -> dict[int, tuple[float, str]]:
        """The best span of each example over its features in part ``part`` of ``data``'s
        rows: ``{example: (score, text)}``."""
        model.eval()
        data = rows_in(data, part)
        best: dict[int, tuple[float, str]] = {}
        for rows in eval_batches(data.lengths, self.batch_size, self.batch_tokens):
            logits = model(**make_batch(data, rows)).cpu()  # (B, L, 2)
            offsets = data.aux["offsets"][rows].cpu()[:, : logits.shape[1]]
            for k, example in enumerate(data.aux["example_ids"][rows].tolist()):
                keep_best(best, example, self.best_span(logits[k], offsets[k], self.contexts[example]))
        return best

    def from_predictions(self, parts: list[dict[int, tuple[float, str]]], data: Encoded) -> dict[str, float]:
        """Exact match and F1 of each example's best span over the parts (an example's
        features may fall in two), the earlier of equal scores, as in one pass."""
        from fedpeft.metrics.qa import qa_scores

        best: dict[int, tuple[float, str]] = {}
        for part in parts:
            for example, span in part.items():
                keep_best(best, example, span)
        examples = sorted(best)
        return qa_scores([best[e][1] for e in examples], [self.answers[e] for e in examples])

    def best_span(self, logits: torch.Tensor, offsets: torch.Tensor, context: str) -> tuple[float, str]:
        """The highest-scoring context span of one feature: ``(score, text)``."""
        inside = offsets[:, 0] >= 0  # context tokens
        if not inside.any():
            return float("-inf"), ""
        pairs = logits[:, 0, None] + logits[None, :, 1]  # (L, L): start i, end j
        length = torch.arange(len(logits))[None, :] - torch.arange(len(logits))[:, None]
        allowed = inside[:, None] & inside[None, :] & (length >= 0) & (length < self.max_answer_tokens)
        flat = int(pairs.masked_fill(~allowed, float("-inf")).argmax())
        i, j = divmod(flat, len(logits))
        return float(pairs[i, j]), context[int(offsets[i, 0]) : int(offsets[j, 1])]


def keep_best(best: dict[int, tuple[float, str]], example: int, span: tuple[float, str]) -> None:
    """``span`` as ``example``'s best unless it already has one scoring as high."""
    if example not in best or span[0] > best[example][0]:
        best[example] = span


def scorer_for(task: str, tokenizer, eval_cfg, corpus=None) -> Scorer:
    """The scorer of ``data.task`` (``eval_cfg``: the ``EvalConfig``; ``corpus``: the
    ``Corpus``, whose tag names or passages and answers NER and QA scoring need)."""
    rows, tokens = eval_cfg.batch_size, eval_cfg.batch_tokens
    if task == "causal_lm":
        return GenerationScorer(tokenizer, eval_cfg.generation, rows, tokens)
    if task == "token_classification":
        return TaggingScorer(corpus.tag_names, rows, tokens)
    if task == "extractive_qa":
        answers = [[text for text, _ in a] for a in corpus.train_answers + corpus.test_answers]
        contexts = corpus.train_contexts + corpus.test_contexts
        return SpanScorer(contexts, answers, rows, eval_cfg.max_answer_tokens, tokens)
    return ClassificationScorer(rows, tokens)
