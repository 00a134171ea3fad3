"""The cross-silo multi-task setting (FedMCP paper, sec. 4.1): each client is a data set of
its own, with its own label space and its own classifier.

``data.silos`` lists the silos, each a data config (source, path, columns, ...). Every
silo's examples are pooled (its own test share included), subsampled to
``data.silo_size`` (the smallest silo's size by default: the paper resizes every GLUE
task to MRPC's), and become one client, split train/validation/test 6:2:2 by the
partition. The silos' classes are laid side by side in one label space,
``<silo>:<class>``; a client's classifier keeps its own silo's classes only
(:func:`fedpeft.methods.base.restrict_heads`), and heads are never aggregated.
"""

from __future__ import annotations

import numpy as np

from fedpeft.data.sources import load_corpus
from fedpeft.data.types import Corpus, DataError


def load_silos(cfg, seed: int) -> Corpus:
    """One corpus holding every silo of ``cfg`` (a ``DataConfig`` with ``silos``) as its
    training pool, grouped by silo name (``train_groups``), each silo's class ids a block of
    its own (``label_spaces``); the global test set is empty."""
    rng = np.random.default_rng([seed, 2])
    silos = []
    for silo in cfg.silos:
        corpus = load_corpus(silo.resolved(cfg), seed)
        texts = corpus.train_texts + corpus.test_texts
        labels = np.concatenate([corpus.train_labels, corpus.test_labels])
        if len(texts) < 5:
            raise DataError(f"data.silos: silo {silo.name!r} has {len(texts)} examples; it needs 5 or more")
        silos.append((silo.name, texts, labels, corpus.class_names))
    size = min(len(texts) for _, texts, _, _ in silos) if cfg.silo_size == "smallest" else cfg.silo_size
    if cfg.max_samples is not None:
        size = min(size or cfg.max_samples, cfg.max_samples)
    texts_all, labels_all, groups, names, spaces = [], [], [], [], []
    for name, texts, labels, class_names in silos:
        keep = (
            np.arange(len(texts))
            if size is None or size >= len(texts)
            else np.sort(rng.choice(len(texts), size=size, replace=False))
        )
        offset = len(names)
        texts_all += [texts[i] for i in keep]
        labels_all.append(labels[keep] + offset)
        groups += [name] * len(keep)
        names += [f"{name}:{c}" for c in class_names]
        spaces.append(np.arange(offset, len(names)))
    return Corpus(
        train_texts=texts_all,
        train_labels=np.concatenate(labels_all).astype(np.int64),
        test_texts=[],
        test_labels=np.zeros(0, dtype=np.int64),
        class_names=names,
        train_groups=np.asarray(groups, dtype=object),
        label_spaces=spaces,
    )
