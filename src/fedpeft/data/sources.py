"""Data sources: a local file, a Hugging Face hub dataset, or the built-in WordNet corpus.

Whatever the source, the result is a :class:`Corpus`: a training pool (which the
partition splits across clients) and a global test set, with integer labels and
their class names. For instruction tuning (``data.task: causal_lm``) the "texts" are
prompts (chat messages), each example has a response, and the labels are domains
(what a natural or Dirichlet partition splits on). Bad input fails with
:class:`DataError`, naming the file, the column or the row at fault.

The global test set is a seeded permutation of its rows (a test file's rows first put
in an order of their content): an evaluation batch is a random draw of the test set,
never a run of one label as a sorted source lists them, and the same rows give the
same batches in whatever order a file lists them.
"""

from __future__ import annotations

import csv
import itertools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedpeft.data.conll import (
    ENTITY_TYPE_CLASSES,
    conll_dir,
    dominant_entity_type,
    entity_set_class,
    read_conll,
    tag_names_of,
)
from fedpeft.data.instructions import definition_prompt, instruction_columns, read_jsonl_messages
from fedpeft.data.qa import read_squad, squad_columns, wordnet_qa
from fedpeft.data.wordnet import LEXNAMES, read_glosses

if TYPE_CHECKING:
    from fedpeft.config import DataConfig

log = logging.getLogger(__name__)

#: The random stream of the global test set's order (beside ``seed``): drawing it
#: changes no other draw.
TEST_ORDER_STREAM = 0x54455354  # "TEST": apart from the rounds' sampling streams [seed, round]


class DataError(ValueError):
    """Input data that cannot be used; the message names the file, column or row."""


@dataclass
class Corpus:
    """A labelled corpus split into a training pool and a test set."""

    train_texts: list  # texts; for causal_lm prompts (lists of chat messages)
    train_labels: np.ndarray  # (N,) int64 in [0, num_classes): classes, or causal_lm domains
    test_texts: list
    test_labels: np.ndarray  # (N_test,) int64
    class_names: list[str]
    train_groups: np.ndarray | None = None  # (N,) values of data.group_column
    train_responses: list[str] | None = None  # causal_lm: what the model should answer
    test_responses: list[str] | None = None
    train_tags: list[list[int]] | None = None  # token_classification: each word's tag id
    test_tags: list[list[int]] | None = None
    tag_names: list[str] | None = None
    train_contexts: list[str] | None = None  # extractive_qa: passages (texts are the questions)
    test_contexts: list[str] | None = None
    train_answers: list[list[tuple[str, int]]] | None = None  # gold (text, start char) pairs
    test_answers: list[list[tuple[str, int]]] | None = None
    #: data.silos: per silo (= client, in order), the class ids of its own label space
    label_spaces: list[np.ndarray] | None = None

    @property
    def num_classes(self) -> int:
        return len(self.class_names)


Columns = dict[str, list[Any]]


def read_table(path: Path, objects: bool = False) -> Columns:
    """A CSV, JSONL/JSON or Parquet file as columns. With ``objects`` a JSONL file's
    values stay Python objects (chat ``messages`` lists)."""
    import pandas as pd

    suffix = path.suffix.lower()
    if objects and suffix == ".jsonl":
        return read_jsonl_messages(path)
    try:
        if suffix in (".csv", ".tsv"):
            frame = pd.read_csv(path, sep="\t" if suffix == ".tsv" else ",")
        elif suffix in (".jsonl", ".json"):
            frame = pd.read_json(path, lines=suffix == ".jsonl")
        elif suffix == ".parquet":
            frame = pd.read_parquet(path)
        else:
            raise DataError(f"{path}: unsupported file type {suffix!r} (csv, tsv, jsonl, json, parquet)")
    except (ValueError, OSError) as err:
        if isinstance(err, DataError):
            raise
        raise DataError(f"{path}: cannot be read as {suffix[1:]}: {err}") from None
    return {str(c): frame[c].tolist() for c in frame.columns}


def load_hub(cfg: DataConfig, split: str) -> tuple[Columns, list[str] | None]:
    """One split of a hub dataset via ``datasets.load_dataset``; class names if it has them."""
    import datasets

    try:
        ds = datasets.load_dataset(cfg.hub_id, cfg.hub_config, split=split)
    except Exception as err:  # network, unknown id, unknown split: all need the id in the message
        raise DataError(f"data.hub_id {cfg.hub_id!r} (split {split!r}) could not be loaded: {err}") from err
    feature = ds.features.get(cfg.label_column)
    feature = getattr(feature, "feature", feature)  # a sequence of class labels (NER tags)
    names = list(feature.names) if hasattr(feature, "names") else None
    return ds.to_dict(), names


def place(origin: str, row: int) -> str:
    """Where data row ``row`` (0-based, of the table read from ``origin``) is, as an editor
    shows it: a CSV or TSV file's line (the header is line 1; blank lines skipped as the
    reader skips them, a quoted field over several lines counted whole), a JSON Lines
    file's line, a JSON or Parquet file's record (1-based); elsewhere (a hub split, a
    held-out share) its row, 0-based."""
    path = Path(origin)
    suffix = path.suffix.lower()
    if path.is_file() and suffix in (".csv", ".tsv"):
        line = _csv_record_line(path, row, "\t" if suffix == ".tsv" else ",")
        return f"{origin}, line {line}"
    if path.is_file() and suffix == ".jsonl":
        lines = (n for n, text in enumerate(path.read_text().splitlines(), 1) if text.strip())
        return f"{origin}, line {next(itertools.islice(lines, row, None), '?')}"
    if path.is_file() and suffix in (".json", ".parquet"):
        return f"{origin}, record {row + 1}"
    return f"{origin}: row {row} (0-based)"


def _csv_record_line(path: Path, row: int, delimiter: str) -> int | str:
    """The line on which data record ``row`` (0-based, after the header) starts."""
    with path.open(newline="") as handle:
        reader = csv.reader(handle, delimiter=delimiter)
        next(reader, None)  # the header
        start, k = reader.line_num + 1, 0
        for record in reader:
            if record:  # a blank line is no record
                if k == row:
                    return start
                k += 1
            start = reader.line_num + 1
    return "?"


def _check_columns(table: Columns, origin: str, cfg: DataConfig, groups: bool = True) -> None:
    """The text, label (and, for training data, group) columns exist and every row has
    text and a label."""
    keys = ["text_column", "label_column"] + (["group_column"] if cfg.group_column and groups else [])
    for key in keys:
        col = getattr(cfg, key)
        if col not in table:
            raise DataError(f"{origin}: no column {col!r} (data.{key}; columns: {sorted(table)})")
    for row, (text, label) in enumerate(zip(table[cfg.text_column], table[cfg.label_column], strict=True)):
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{place(origin, row)}: column {cfg.text_column!r} is empty or not text")
        if label is None or (isinstance(label, float) and np.isnan(label)):
            raise DataError(f"{place(origin, row)}: column {cfg.label_column!r} is missing")


def class_names_of(values: list[Any]) -> list[str]:
    """Distinct label values as class names: numeric order when all are numbers (so 2 < 10),
    else string order. ``1`` and ``1.0`` are the same class."""
    distinct = set(values)
    if all(_is_number(v) for v in distinct):
        return list(dict.fromkeys(_label_key(v) for v in sorted(distinct)))
    return sorted({_label_key(v) for v in distinct})


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def _label_key(v: Any) -> str:
    """The class name of a label value: ``1`` and ``1.0`` -> ``"1"``; text as it is."""
    if _is_number(v):
        return str(int(v)) if float(v).is_integer() else str(float(v))
    return str(v)


def _encode_labels(values: list[Any], names: list[str], origin: str, known_ids: bool) -> np.ndarray:
    """Label ids for ``values``: range-checked ids (``known_ids``) or indices into ``names``."""
    if known_ids:  # already integer ids with known names (hub ClassLabel)
        ids = np.asarray(values, dtype=np.int64)
        bad = np.flatnonzero((ids < 0) | (ids >= len(names)))
        if bad.size:
            raise DataError(f"{place(origin, bad[0])}: label {ids[bad[0]]} outside 0..{len(names) - 1}")
        return ids
    index = {n: i for i, n in enumerate(names)}
    return np.asarray([index[_label_key(v)] for v in values], dtype=np.int64)


def load_corpus(cfg: DataConfig, seed: int) -> Corpus:
    """Read the configured source and split it into training pool and global test set."""
    names: list[str] | None = None
    test: Columns | None = None
    lm, ner, qa = cfg.task == "causal_lm", cfg.task == "token_classification", cfg.task == "extractive_qa"
    text_col, label_col = cfg.text_column, cfg.label_column
    if qa:
        table, origin, test, test_origin = _qa_tables(cfg)
        text_col, label_col = "question", "label"
    elif cfg.source == "conll2003":  # train.txt is the pool, test.txt the global test set
        root = conll_dir()
        table, origin = _conll_table(root / "train.txt"), str(root / "train.txt")
        test, test_origin = _conll_table(root / "test.txt"), str(root / "test.txt")
        if not ner:  # classification: a sentence -> its most frequent entity type
            table, test = _entity_type_table(table), _entity_type_table(test)
            names = list(ENTITY_TYPE_CLASSES)
    elif ner and cfg.source == "file" and cfg.path.suffix.lower() not in TABLE_SUFFIXES:
        table, origin = _conll_table(cfg.path), str(cfg.path)
        if cfg.test_path is not None:
            test, test_origin = _conll_table(cfg.test_path), str(cfg.test_path)
    elif cfg.source == "wordnet":
        table, origin = read_glosses(cfg.wordnet_dir), str(cfg.wordnet_dir)
        if cfg.wordnet_pos:  # only some parts of speech, and then only their categories
            rows = [i for i, p in enumerate(table["pos"]) if p in cfg.wordnet_pos]
            table = {k: [v[i] for i in rows] for k, v in table.items()}
        table["lexname"] = table["label"]
        if cfg.wordnet_labels == "pos" and not lm:
            names = [p for p in ("noun", "verb", "adj", "adv") if p in set(table["pos"])]
            column = table["pos"]
        else:
            names = list(LEXNAMES) if not cfg.wordnet_pos else sorted(set(table["label"]), key=LEXNAMES.index)
            column = table["label"]
        class_id = {name: i for i, name in enumerate(names)}
        table["label"] = [class_id[v] for v in column]
        text_col, label_col = "text", "label"
        if lm:  # definition generation: lemma and part of speech -> gloss; the lexname is the domain
            table["response"] = table["text"]
            table["text"] = [
                definition_prompt(w, p) for w, p in zip(table["lemma"], table["pos"], strict=True)
            ]
    elif cfg.source == "file":
        assert cfg.path is not None
        table, origin = read_table(cfg.path, objects=lm), str(cfg.path)
        if cfg.test_path is not None:
            test, test_origin = read_table(cfg.test_path, objects=lm), str(cfg.test_path)
    else:
        table, names = load_hub(cfg, cfg.train_split)
        origin = f"{cfg.hub_id}[{cfg.train_split}]"
        if cfg.test_split:
            test, _ = load_hub(cfg, cfg.test_split)
            test_origin = f"{cfg.hub_id}[{cfg.test_split}]"
    if lm and cfg.source != "wordnet":
        names = None  # domains are read as text
        table = _instruction_table(table, origin, cfg)
        test = _instruction_table(test, test_origin, cfg) if test is not None else None
        text_col, label_col = "text", "label"
    elif qa:
        pass
    elif ner:
        if "tags" not in table:  # a table (file or hub) with word and tag columns
            table = _tagged_columns(table, origin, cfg, names)
            test = _tagged_columns(test, test_origin, cfg, names) if test is not None else None
        names, text_col, label_col = None, "text", "label"  # entity-set classes, as text
    elif cfg.source != "wordnet":
        _check_columns(table, origin, cfg)
    rng = np.random.default_rng(seed)
    n = len(table[text_col])
    known_ids = names is not None
    own_test = test is not None
    if test is None:  # a seeded held-out share: the classes are those of the whole table
        order = rng.permutation(n)
        n_test = max(1, int(round(cfg.test_fraction * n)))
        test_idx, train_idx = np.sort(order[:n_test]), np.sort(order[n_test:])
        test = {k: [v[i] for i in test_idx] for k, v in table.items()}
        table = {k: [v[i] for i in train_idx] for k, v in table.items()}
        test_origin = f"{origin} (held-out share)"
        if names is None:
            names = class_names_of(table[label_col] + test[label_col])
    else:  # a test set of its own: its labels map onto the training classes
        if not (lm or ner or qa):
            _check_columns(test, test_origin, cfg, groups=False)
        if names is None and (lm or ner or qa):  # domains, entity sets: the test set may have others
            names = class_names_of(table[label_col] + test[label_col])
        elif names is None:
            names = class_names_of(table[label_col])
            test = _known_labels_only(test, label_col, names, test_origin, cfg.unseen_test_labels)
    train_labels = _encode_labels(table[label_col], names, origin, known_ids)
    test_labels = _encode_labels(test[label_col], names, test_origin, known_ids)
    keep = _subsample(len(train_labels), cfg.max_samples, rng)
    # a test set of its own is drawn from its rows in an order of their content (the same
    # rows, listed in any order, give the same test set); every test set is then scored
    # in a seeded random order
    listed = _content_order(test) if own_test else np.arange(len(test_labels))
    keep_test = listed[_subsample(len(test_labels), cfg.max_test_samples, rng)]
    keep_test = keep_test[np.random.default_rng([seed, TEST_ORDER_STREAM]).permutation(len(keep_test))]
    group_col = cfg.group_column or ("pos" if cfg.source == "wordnet" and not qa else None)
    if group_col and group_col not in table:
        raise DataError(f"{origin}: no column {group_col!r} (data.group_column; columns: {sorted(table)})")
    groups = np.asarray(table[group_col], dtype=object)[keep] if group_col else None
    tags = {}
    if ner:
        tag_names = tag_names_of(table["tags"] + test["tags"])
        tag_id = {t: i for i, t in enumerate(tag_names)}
        tags = {
            "tag_names": tag_names,
            "train_tags": [[tag_id[t] for t in table["tags"][i]] for i in keep],
            "test_tags": [[tag_id[t] for t in test["tags"][i]] for i in keep_test],
        }
    if qa:
        tags = {
            "train_contexts": [table["context"][i] for i in keep],
            "test_contexts": [test["context"][i] for i in keep_test],
            "train_answers": [
                list(zip(table["answers"][i], table["answer_starts"][i], strict=True)) for i in keep
            ],
            "test_answers": [
                list(zip(test["answers"][i], test["answer_starts"][i], strict=True)) for i in keep_test
            ],
        }
    corpus = Corpus(
        train_texts=[table[text_col][i] for i in keep],
        train_labels=train_labels[keep],
        test_texts=[test[text_col][i] for i in keep_test],
        test_labels=test_labels[keep_test],
        class_names=names,
        train_groups=groups,
        train_responses=[table["response"][i] for i in keep] if lm else None,
        test_responses=[test["response"][i] for i in keep_test] if lm else None,
        **tags,
    )
    if cfg.question_clusters:
        corpus = cluster_questions(corpus, cfg.question_clusters, seed)
    return corpus


def _answers(table: Columns, row: int) -> list[tuple[str, int]]:
    return list(zip(table["answers"][row], table["answer_starts"][row], strict=True))


def _qa_tables(cfg: DataConfig) -> tuple[Columns, str, Columns | None, str]:
    """Extractive-QA data as SQuAD columns plus ``label`` (its class: the
    ``data.label_column`` values, e.g. a SQuAD article's ``title``; WordNet's lexicographer
    category; else one class, ``all``): ``(table, origin, test table or None, its origin)``."""
    test, test_origin = None, ""
    if cfg.source == "wordnet":
        return wordnet_qa(read_glosses(cfg.wordnet_dir)), str(cfg.wordnet_dir), None, ""
    if cfg.source == "file":
        assert cfg.path is not None
        table, origin = read_squad(cfg.path), str(cfg.path)
        if cfg.test_path is not None:
            test, test_origin = read_squad(cfg.test_path), str(cfg.test_path)
    else:
        raw, _ = load_hub(cfg, cfg.train_split)
        origin = f"{cfg.hub_id}[{cfg.train_split}]"
        table = squad_columns(raw, origin)
        if cfg.test_split:
            test_origin = f"{cfg.hub_id}[{cfg.test_split}]"
            test = squad_columns(load_hub(cfg, cfg.test_split)[0], test_origin)
    for t, where in ((table, origin), (test, test_origin)):
        if t is None:
            continue
        if not t["question"]:
            raise DataError(f"{where}: no answerable questions")
        if cfg.label_column in t:
            t["label"] = [str(v) for v in t[cfg.label_column]]
        elif "label_column" in cfg.model_fields_set:
            raise DataError(f"{where}: no column {cfg.label_column!r} (columns: {sorted(t)})")
        else:
            t["label"] = ["all"] * len(t["question"])
    return table, origin, test, test_origin


def cluster_questions(corpus: Corpus, k: int, seed: int) -> Corpus:
    """The corpus with its classes replaced by k-means clusters (scikit-learn, seeded) of
    the questions' sentence embeddings (the bundled all-MiniLM-L6-v2, a sentence-
    transformers model): the FeDeRA paper's partition of SQuAD."""
    from sentence_transformers import SentenceTransformer
    from sklearn.cluster import KMeans

    from fedpeft.models.backbone import bundled_minilm_dir

    questions = list(corpus.train_texts) + list(corpus.test_texts)
    if len(questions) < k:
        raise DataError(f"data.question_clusters: {k} clusters for {len(questions)} questions")
    encoder = SentenceTransformer(str(bundled_minilm_dir()), device="cpu")
    vectors = encoder.encode(questions, batch_size=128, normalize_embeddings=True, show_progress_bar=False)
    clusters = KMeans(n_clusters=k, n_init=4, random_state=seed).fit_predict(vectors)
    n = len(corpus.train_texts)
    corpus.train_labels = clusters[:n].astype(np.int64)
    corpus.test_labels = clusters[n:].astype(np.int64)
    corpus.class_names = [f"cluster {c}" for c in range(k)]
    return corpus


TABLE_SUFFIXES = (".csv", ".tsv", ".jsonl", ".json", ".parquet")


def _conll_table(path: Path) -> Columns:
    """A CoNLL file as columns ``text`` (words), ``tags`` and ``label`` (entity set)."""
    sentences = read_conll(path)
    if not sentences:
        raise DataError(f"{path}: no sentences (a CoNLL file: one word and its tag per line)")
    return {
        "text": [w for w, _ in sentences],
        "tags": [t for _, t in sentences],
        "label": [entity_set_class(t) for _, t in sentences],
    }


def _entity_type_table(table: Columns) -> Columns:
    """A CoNLL table as sentence classification: ``text`` the sentence, ``label`` its
    most frequent entity type (:func:`fedpeft.data.conll.dominant_entity_type`)."""
    return {
        "text": [" ".join(words) for words in table["text"]],
        "label": [ENTITY_TYPE_CLASSES.index(dominant_entity_type(tags)) for tags in table["tags"]],
    }


def _tagged_columns(table: Columns, origin: str, cfg: DataConfig, tag_names: list[str] | None) -> Columns:
    """A table whose ``data.text_column`` holds each sentence's words and
    ``data.label_column`` their tags (names, or ids into the hub's ``tag_names``) as the
    CoNLL columns."""
    for col in (cfg.text_column, cfg.label_column):
        if col not in table:
            raise DataError(f"{origin}: no column {col!r} (columns: {sorted(table)})")
    out: Columns = {"text": [], "tags": [], "label": []}
    for row, (words, tags) in enumerate(zip(table[cfg.text_column], table[cfg.label_column], strict=True)):
        words, tags = list(words), list(tags)
        if tag_names is not None:
            tags = [tag_names[t] for t in tags]
        if not words or len(words) != len(tags) or not all(isinstance(x, str) for x in words + tags):
            raise DataError(
                f"{place(origin, row)}: {cfg.text_column!r} and {cfg.label_column!r} must be "
                "lists of words and of their tags, of the same length"
            )
        out["text"].append(words)
        out["tags"].append(tags)
        out["label"].append(entity_set_class(tags))
    return out


def _instruction_table(table: Columns, origin: str, cfg: DataConfig) -> Columns:
    """An instruction file or dataset (Alpaca-style or chat ``messages``) as columns
    ``text`` (the prompt's messages), ``response`` and ``label`` (the domain: the
    ``data.label_column`` values when the table has that column, else one domain, ``all``;
    a label column named in the config must exist), plus the group column if any."""
    prompts, responses = instruction_columns(table, origin)
    explicit = "label_column" in cfg.model_fields_set
    if cfg.label_column in table:
        domains = table[cfg.label_column]
        for row, d in enumerate(domains):
            if d is None or (isinstance(d, float) and np.isnan(d)):
                raise DataError(f"{place(origin, row)}: column {cfg.label_column!r} is missing")
    elif explicit:
        raise DataError(f"{origin}: no column {cfg.label_column!r} (columns: {sorted(table)})")
    else:
        domains = ["all"] * len(prompts)
    out = {"text": prompts, "response": responses, "label": list(domains)}
    if cfg.group_column:
        if cfg.group_column not in table:
            raise DataError(f"{origin}: no column {cfg.group_column!r} (columns: {sorted(table)})")
        out[cfg.group_column] = table[cfg.group_column]
    return out


def _known_labels_only(test: Columns, label_col: str, names: list[str], origin: str, unseen: str) -> Columns:
    """The test rows whose label is one of the training classes ``names``. A row with
    another label is an error naming ``origin`` and the row (``unseen: error``), or is left
    out, with the count logged (``unseen: drop``)."""
    known = set(names)
    keep = [_label_key(v) in known for v in test[label_col]]
    if all(keep):
        return test
    row = keep.index(False)
    if unseen == "error":
        raise DataError(
            f"{place(origin, row)}: label {_label_key(test[label_col][row])!r} never occurs in "
            f"the training data ({len(names)} classes, e.g. {names[:3]}); set data.unseen_test_labels: drop "
            "to leave such rows out"
        )
    dropped = len(keep) - sum(keep)
    if dropped == len(keep):
        raise DataError(
            f"{origin}: none of its {len(keep)} rows has a label that occurs in the training data"
        )
    unseen_labels = sorted({_label_key(v) for v, k in zip(test[label_col], keep, strict=True) if not k})
    log.warning(
        "%s: dropped %d of %d test rows whose label never occurs in the training data (%s)",
        origin, dropped, len(keep), ", ".join(unseen_labels[:5]) + (" ..." if len(unseen_labels) > 5 else ""),
    )  # fmt: skip
    return {k: [x for x, k_ in zip(v, keep, strict=True) if k_] for k, v in test.items()}


def _content_order(table: Columns) -> np.ndarray:
    """``table``'s row indices sorted by the rows' content (every column's value): the
    same rows listed in any order come out in the same order of content."""
    columns = sorted(table)
    key = [tuple(repr(table[c][i]) for c in columns) for i in range(len(table[columns[0]]))]
    return np.asarray(sorted(range(len(key)), key=key.__getitem__), dtype=np.int64)


def _subsample(n: int, cap: int | None, rng: np.random.Generator) -> np.ndarray:
    if cap is None or cap >= n:
        return np.arange(n)
    return np.sort(rng.choice(n, size=cap, replace=False))


def load_client_file(path: Path, cfg: DataConfig, class_names: list[str]) -> tuple[list[str], np.ndarray]:
    """One deployed client's own data file: its texts and their label ids in the
    federation's class list (a label the federation does not know fails, naming the row)."""
    table = read_table(path)
    _check_columns(table, str(path), cfg)
    index = {name: i for i, name in enumerate(class_names)}
    labels = []
    for row, value in enumerate(table[cfg.label_column]):
        key = _label_key(value)
        if key not in index:
            raise DataError(
                f"{place(str(path), row)}: label {key!r} is not one of the federation's "
                f"{len(class_names)} classes (e.g. {class_names[:3]})"
            )
        labels.append(index[key])
    return list(table[cfg.text_column]), np.asarray(labels, dtype=np.int64)
