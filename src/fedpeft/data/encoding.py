"""A corpus tokenised for its task: each task's encoder (plain texts, chat prompts with
responses, words with their tags, questions over context windows) picked by what the
corpus holds."""

from __future__ import annotations

from fedpeft.data.conll import encode_words
from fedpeft.data.instructions import encode_instructions
from fedpeft.data.qa import encode_qa
from fedpeft.data.task import Encoded, encode
from fedpeft.data.types import Corpus


def encode_corpus(corpus: Corpus, tokenizer, cfg) -> tuple[Encoded, Encoded]:
    """A :class:`~fedpeft.data.types.Corpus`'s training pool and global test set,
    tokenised for its task (``cfg``: the ``DataConfig``): texts with class labels, or
    prompts with responses (:func:`fedpeft.data.instructions.encode_instructions`)."""
    if corpus.train_contexts is not None:  # extractive QA: test examples numbered after the pool's

        def features(questions, contexts, answers, first_id):
            starts, texts = [a[0][1] for a in answers], [a[0][0] for a in answers]
            return encode_qa(
                questions, contexts, starts, texts, tokenizer, cfg.max_length, cfg.stride, first_id
            )

        return (
            features(corpus.train_texts, corpus.train_contexts, corpus.train_answers, 0),
            features(corpus.test_texts, corpus.test_contexts, corpus.test_answers, len(corpus.train_texts)),
        )
    if corpus.train_tags is not None:
        return (
            encode_words(corpus.train_texts, corpus.train_tags, tokenizer, cfg.max_length),
            encode_words(corpus.test_texts, corpus.test_tags, tokenizer, cfg.max_length),
        )
    if corpus.train_responses is None:
        return (
            encode(corpus.train_texts, corpus.train_labels, tokenizer, cfg.max_length),
            encode(corpus.test_texts, corpus.test_labels, tokenizer, cfg.max_length),
        )
    return (
        encode_instructions(corpus.train_texts, corpus.train_responses, tokenizer, cfg.max_length,
                            cfg.system_prompt, "training data"),
        encode_instructions(corpus.test_texts, corpus.test_responses, tokenizer, cfg.max_length,
                            cfg.system_prompt, "test data"),
    )  # fmt: skip
