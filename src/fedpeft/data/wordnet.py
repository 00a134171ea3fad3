"""Built-in corpus: WordNet 3.0 glosses labelled with their lexicographer category.

Reads the database files of Debian's ``wordnet-base`` package (``data.noun``,
``data.verb``, ``data.adj``, ``data.adv`` under ``/usr/share/wordnet``) at run time,
so no third-party text lives in this repository. Each synset gives one example:

- ``text``: the gloss's definition (the part before its quoted usage examples);
- ``label``: the synset's lexicographer file, one of the 45 names below
  (noun.animal, verb.motion, ...), a real topic-classification target;
- ``pos``: the part of speech, a natural grouping column;
- ``lemma``: the synset's first word (underscores as spaces), whose definition the
  gloss is (the definition-generation task's prompt);
- ``words``: all the synset's words, and ``examples``: the quoted usage examples of its
  gloss (the extractive-QA task's answers and passages).

Record format (wndb(5WN)): ``offset lex_filenum ss_type w_cnt word lex_id ... | gloss``;
an adjective's word may carry a syntactic marker, ``(a)``, ``(p)`` or ``(ip)``, dropped here.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

# lexnames(5WN): the lexicographer file names, indexed by lex_filenum.
LEXNAMES: tuple[str, ...] = (
    "adj.all", "adj.pert", "adv.all", "noun.Tops", "noun.act", "noun.animal",
    "noun.artifact", "noun.attribute", "noun.body", "noun.cognition", "noun.communication",
    "noun.event", "noun.feeling", "noun.food", "noun.group", "noun.location", "noun.motive",
    "noun.object", "noun.person", "noun.phenomenon", "noun.plant", "noun.possession",
    "noun.process", "noun.quantity", "noun.relation", "noun.shape", "noun.state",
    "noun.substance", "noun.time", "verb.body", "verb.change", "verb.cognition",
    "verb.communication", "verb.competition", "verb.consumption", "verb.contact",
    "verb.creation", "verb.emotion", "verb.motion", "verb.perception", "verb.possession",
    "verb.social", "verb.stative", "verb.weather", "adj.ppl",
)  # fmt: skip

_POS_FILES = {"noun": "data.noun", "verb": "data.verb", "adj": "data.adj", "adv": "data.adv"}


class WordNetMissing(FileNotFoundError):
    """The WordNet database is not installed where the config says."""


def definition_of(gloss: str) -> str:
    """The definition part of a gloss: drop the quoted usage examples after it."""
    cut = gloss.find('"')
    text = gloss if cut < 0 else gloss[:cut]
    return text.strip().rstrip(";").strip()


def read_glosses(wordnet_dir: str | Path = "/usr/share/wordnet") -> dict[str, list]:
    """All synsets as columns ``text``, ``label`` (lexname), ``pos``, ``lemma``, ``words``
    and ``examples``; in file order. Parsed once per process while the files are
    unchanged (a sweep, a benchmark or the test suite builds many experiments); each call
    gets lists of its own."""
    root = Path(wordnet_dir)
    files = [root / f for f in _POS_FILES.values()]
    stamp = tuple(f.stat().st_mtime_ns if f.is_file() else None for f in files)
    return {k: list(v) for k, v in _parse_glosses(str(root), stamp).items()}


@functools.lru_cache(maxsize=2)
def _parse_glosses(wordnet_dir: str, stamp: tuple) -> dict[str, list]:
    """:func:`read_glosses` itself; ``stamp`` (the files' modification times) keys the cache."""
    root = Path(wordnet_dir)
    texts: list[str] = []
    labels: list[str] = []
    pos: list[str] = []
    lemmas: list[str] = []
    words: list[list[str]] = []
    examples: list[list[str]] = []
    for part, fname in _POS_FILES.items():
        path = root / fname
        if not path.is_file():
            raise WordNetMissing(
                f"{path}: WordNet database not found; install Debian's wordnet-base "
                "(scripts/setup.sh does) or set data.wordnet_dir"
            )
        with path.open(encoding="utf-8", errors="replace") as fh:
            for lineno, line in enumerate(fh, 1):
                if line.startswith("  "):  # licence header
                    continue
                head, sep, gloss = line.partition(" | ")
                fields = head.split(" ", 5)
                if not sep or len(fields) < 6 or not fields[1].isdigit():
                    raise ValueError(f"{path}:{lineno}: not a WordNet data record")
                text = definition_of(gloss)
                if text:
                    texts.append(text)
                    labels.append(LEXNAMES[int(fields[1])])
                    pos.append(part)
                    count = int(fields[3], 16)
                    names = head.split(" ")[4 : 4 + 2 * count : 2]
                    names = [re.sub(r"\((a|p|ip)\)$", "", w).replace("_", " ") for w in names]
                    lemmas.append(names[0])
                    words.append(names)
                    examples.append([e.strip() for e in re.findall(r'"([^"]+)"', gloss) if e.strip()])
    return {"text": texts, "label": labels, "pos": pos, "lemma": lemmas, "words": words, "examples": examples}
