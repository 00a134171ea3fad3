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

from fedpeft.data.task import IGNORE, Encoded, eval_batches, make_batch
from fedpeft.engines.local import predict_cohort
from fedpeft.metrics.classification import predict, scores

Tensors = dict[str, torch.Tensor]
Loader = Callable[[Tensors], None]


class Scorer(Protocol):
    def score(self, model: torch.nn.Module, data: Encoded) -> dict[str, float]:
        """The model, as loaded, on ``data``."""

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

    # a score that splits over rows (the ranks of a run: fedpeft.engines.ranks)
    def predictions(self, model: torch.nn.Module, data: Encoded) -> np.ndarray:
        """The model's predictions of ``data``'s rows (part of what :meth:`from_predictions` scores)."""
        return predict(model, data, self.batch_size, self.batch_tokens)

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


class OneAtATime:
    """Scores clients' models one after another, each loaded into the model in turn."""

    def score(self, model: torch.nn.Module, data: Encoded) -> dict[str, float]:
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

    def nll(self, model: torch.nn.Module, data: Encoded) -> dict[str, float]:
        """The mean negative log-likelihood per response token of ``data`` and its perplexity."""
        from fedpeft.models.causal import response_nll

        nll, count = response_nll(model, data, self.batch_size, self.batch_tokens)
        mean = nll / count if count else float("nan")
        return {"nll": mean, "perplexity": math.exp(mean) if count else float("nan")}

    def score(self, model: torch.nn.Module, data: Encoded) -> dict[str, float]:
        from fedpeft.metrics.generation import generation_scores
        from fedpeft.models.causal import generate, references_of

        likelihood = self.nll(model, data)
        scored = torch.nonzero((data.labels != IGNORE).any(-1)).flatten().cpu()
        shown = data.subset(scored[: self.options.samples] if self.options.samples else scored)
        predictions = generate(model, shown, self.tokenizer, self.options, self.batch_size, self.batch_tokens)
        return {**likelihood, **generation_scores(predictions, references_of(shown, self.tokenizer))}


class TaggingScorer(OneAtATime):
    def __init__(self, tag_names: list[str], batch_size: int, batch_tokens: int | None = None):
        self.tag_names, self.batch_size, self.batch_tokens = tag_names, batch_size, batch_tokens

    def score(self, model: torch.nn.Module, data: Encoded) -> dict[str, float]:
        return self.from_predictions([self.predictions(model, data)], data)

    # a score that splits over rows (the ranks of a run: fedpeft.engines.ranks)
    @torch.no_grad()
    def predictions(self, model: torch.nn.Module, data: Encoded) -> tuple[list[list[str]], list[list[str]]]:
        """Each row's predicted and gold tags at its words' first sub-words."""
        model.eval()
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
    def score(self, model: torch.nn.Module, data: Encoded) -> dict[str, float]:
        from fedpeft.metrics.qa import qa_scores

        model.eval()
        best: dict[int, tuple[float, str]] = {}
        for rows in eval_batches(data.lengths, self.batch_size, self.batch_tokens):
            logits = model(**make_batch(data, rows)).cpu()  # (B, L, 2)
            offsets = data.aux["offsets"][rows].cpu()[:, : logits.shape[1]]
            for k, example in enumerate(data.aux["example_ids"][rows].tolist()):
                score, text = self.best_span(logits[k], offsets[k], self.contexts[example])
                if example not in best or score > best[example][0]:
                    best[example] = (score, text)
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
