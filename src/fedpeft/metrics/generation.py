"""Scores of generated text against references, from standard libraries.

Corpus-level BLEU, chrF and TER (sacrebleu, its default settings), and the mean over
examples of ROUGE-L F1 (``rouge_score``, Porter stemming), METEOR (NLTK, with WordNet
3.0 from Debian's ``wordnet-base`` for its synonym stage) and exact match (SQuAD's answer
normalisation). All on a 0-100 scale; lower is better for TER only.

NLTK reads WordNet through its own corpus reader, which wants a ``lexnames`` file that
Debian does not ship and refuses paths outside its data roots, so the first METEOR
score copies the database into ``$FEDPEFT_CACHE`` (default ``~/.cache/fedpeft``) with
that file written from :data:`fedpeft.data.wordnet.LEXNAMES` (about 30 MB, once).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import string
import warnings
from pathlib import Path

import numpy as np

#: Every score this module computes, and whether higher is better.
HIGHER_IS_BETTER = {
    "bleu": True,
    "chrf": True,
    "ter": False,
    "rouge_l": True,
    "meteor": True,
    "exact_match": True,
}


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles (a, an, the),
    single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, reference: str) -> float:
    """1.0 when the two are equal after :func:`normalize_answer`, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(reference))


def words(text: str) -> list[str]:
    """Lower-cased word and punctuation tokens (METEOR's input)."""
    return re.findall(r"\w+|[^\w\s]", text.lower())


def cache_dir() -> Path:
    return Path(os.environ.get("FEDPEFT_CACHE", Path.home() / ".cache" / "fedpeft"))


@functools.lru_cache(maxsize=1)
def wordnet_reader(source: str = "/usr/share/wordnet"):
    """NLTK's WordNet reader over the installed WordNet 3.0 database (see the module
    docstring for why a copy)."""
    import nltk
    from nltk.corpus.reader.wordnet import WordNetCorpusReader

    from fedpeft.data.wordnet import LEXNAMES, WordNetMissing

    root = cache_dir() / "wordnet-nltk"
    if not (root / "lexnames").is_file():
        src = Path(source)
        if not (src / "data.noun").is_file():
            raise WordNetMissing(f"{src}: WordNet database not found (METEOR needs it); install wordnet-base")
        tmp = root.with_name(f"{root.name}.partial-{os.getpid()}")  # processes may race to build it
        tmp.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file():
                shutil.copyfile(f, tmp / f.name)
        category = {"noun": 1, "verb": 2, "adj": 3, "adv": 4}  # lexnames(5WN): syntactic category
        lines = (f"{i:02d}\t{name}\t{category[name.split('.')[0]]}\n" for i, name in enumerate(LEXNAMES))
        (tmp / "lexnames").write_text("".join(lines))
        try:
            tmp.rename(root)
        except OSError:  # another process finished first: its copy is the same
            shutil.rmtree(tmp, ignore_errors=True)
    if str(root) not in nltk.data.path:
        nltk.data.path.append(str(root))

    class WordNet30(WordNetCorpusReader):
        def map_wn(self, version="wordnet"):
            return None  # this *is* WordNet 3.0: nothing to map (the base class would look for nltk_data)

    with warnings.catch_warnings():  # "multilingual functions are not available": none are used
        warnings.simplefilter("ignore")
        return WordNet30(str(root), None)


def meteor(prediction: str, reference: str) -> float:
    """NLTK's METEOR (exact, stem and WordNet-synonym matches; alpha 0.9, beta 3, gamma 0.5)."""
    from nltk.translate.meteor_score import meteor_score

    return float(meteor_score([words(reference)], words(prediction), wordnet=wordnet_reader()))


@functools.lru_cache(maxsize=1)
def _rouge():
    from rouge_score.rouge_scorer import RougeScorer

    return RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1: the longest common subsequence of (stemmed) words."""
    return float(_rouge().score(reference, prediction)["rougeL"].fmeasure)


def generation_scores(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Every score of this module for ``predictions[i]`` against ``references[i]``."""
    import sacrebleu

    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    if not predictions:
        return {k: float("nan") for k in HIGHER_IS_BETTER}
    refs = [references]
    return {
        "bleu": float(sacrebleu.corpus_bleu(predictions, refs).score),
        "chrf": float(sacrebleu.corpus_chrf(predictions, refs).score),
        "ter": float(sacrebleu.corpus_ter(predictions, refs).score),
        "rouge_l": 100
        * float(np.mean([rouge_l(p, r) for p, r in zip(predictions, references, strict=True)])),
        "meteor": 100 * float(np.mean([meteor(p, r) for p, r in zip(predictions, references, strict=True)])),
        "exact_match": 100
        * float(np.mean([exact_match(p, r) for p, r in zip(predictions, references, strict=True)])),
    }
