"""The ``data`` and ``partition`` sections: where the examples come from, how they become
model inputs, and how the training pool is split across clients."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field, model_serializer, model_validator

from fedpeft.config.common import Strict


class DataConfig(BaseModel):
    """Where the examples come from and how they become model inputs."""

    model_config = Strict

    task: Literal["classification", "causal_lm", "token_classification", "extractive_qa"] = Field(
        "classification",
        description="classification: text -> one of the label column's classes; causal_lm: instruction "
        "tuning of a decoder (prompt -> response, loss on response tokens only), scored by perplexity "
        "and generation metrics (with source wordnet: definition generation); token_classification: "
        "NER, a tag per word (BIO), scored by entity-level F1 (seqeval); extractive_qa: an answer "
        "span of a context passage (SQuAD), scored by exact match and F1 (with source wordnet: the "
        "built-in WordNet usage-example QA set).",
    )
    source: Literal["wordnet", "file", "hub", "conll2003"] = Field(
        "wordnet",
        description="wordnet: built-in WordNet glosses -> lexicographer category (45 classes), or "
        "lemma -> definition (task causal_lm); file: a local CSV/JSONL/Parquet file (for causal_lm "
        "Alpaca-style instruction/input/output or chat `messages` JSONL; for token_classification a "
        "CoNLL file, or a table of word and tag lists); hub: a Hugging Face dataset id; conll2003: the "
        "built-in CoNLL-2003 English NER corpus (task token_classification).",
    )
    system_prompt: str | None = Field(
        None,
        description="causal_lm: a system message put before every prompt that has none (None: the chat "
        "template's own default, if any).",
    )
    path: Path | None = Field(None, description="Local data file (source: file).")
    test_path: Path | None = Field(
        None,
        description="A separate local test file with the same columns (source: file); its labels are "
        "mapped onto the training file's classes. Without it a seeded share of data.path is held out.",
    )
    unseen_test_labels: Literal["error", "drop"] = Field(
        "error",
        description="A test row (data.test_path, or the hub's test_split) whose label never occurs in "
        "training: error names the file and row; drop leaves such rows out and reports how many.",
    )
    hub_id: str | None = Field(None, description="Dataset id for datasets.load_dataset (source: hub).")
    hub_config: str | None = Field(None, description="Dataset configuration name (source: hub).")
    train_split: str = "train"
    test_split: str | None = Field(
        None, description="The dataset's own test split; if unset a seeded share is held out."
    )
    test_fraction: float = Field(
        0.2, gt=0, lt=1, description="Held-out share when there is no test split or test file."
    )
    text_column: str = "text"
    label_column: str = Field(
        "label",
        description="The class column (classification); for causal_lm an optional domain column that "
        "partitions clients (without it every example is in one domain).",
    )
    group_column: str | None = Field(
        None,
        description="Column whose values group the examples, for partition.scheme natural (a client per "
        "value) and groups (a group of clients per value, e.g. a language column). Source wordnet: 'pos' "
        "(part of speech: noun, verb, adj, adv; the default there) or 'lexname'.",
    )
    max_samples: int | None = Field(
        None, gt=0, description="Seeded subsample of the training pool (None: use all)."
    )
    max_test_samples: int | None = Field(None, gt=0, description="Cap on the global test set.")
    max_length: int = Field(64, gt=1, description="Truncate token sequences to this length.")
    stride: int = Field(
        32, ge=0, description="extractive_qa: tokens shared by consecutive windows of a long context."
    )
    question_clusters: int | None = Field(
        None,
        ge=2,
        description="extractive_qa: classes (what the partition splits on) are this many k-means clusters "
        "of the questions' sentence embeddings (bundled MiniLM), as the FeDeRA paper partitions SQuAD; "
        "None: the label column (e.g. a SQuAD article's title) or WordNet's lexicographer category.",
    )
    wordnet_dir: Path = Field(
        Path("/usr/share/wordnet"), description="WordNet 3.0 database (Debian wordnet-base)."
    )
    wordnet_labels: Literal["lexname", "pos"] = Field(
        "lexname",
        description="source wordnet, task classification: what a gloss is classified by, its "
        "lexicographer category (45 classes) or its part of speech (noun, verb, adj, adv).",
    )
    wordnet_pos: list[Literal["noun", "verb", "adj", "adv"]] | None = Field(
        None, description="source wordnet: only the synsets of these parts of speech (None: all)."
    )
    silos: list[SiloConfig] | None = Field(
        None,
        description="The cross-silo multi-task setting (FedMCP): one client per entry, each a data set "
        "of its own with its own label space and classifier, given as a data config (source, path, "
        "columns, ...; unset keys are taken from this data config). Each silo's examples are pooled, "
        "subsampled to data.silo_size and split train/validation/test per partition.val_fraction and "
        "partition.local_test_fraction (default 6:2:2); there is no global test set, and heads must be "
        "personal (method.head: personal).",
    )
    silo_size: Literal["smallest"] | Annotated[int, Field(gt=0)] | None = Field(
        "smallest",
        description="data.silos: examples kept per silo (seeded subsample): 'smallest' (the smallest "
        "silo's size, as the FedMCP paper balances GLUE), a number, or None (all). data.max_samples "
        "caps it too.",
    )

    @model_validator(mode="after")
    def _source_fields(self) -> DataConfig:
        if self.source == "file":
            if self.path is None:
                raise ValueError("data.path is required when data.source is 'file'")
            if not self.path.is_file():
                raise ValueError(f"data.path: no such file: {self.path}")
        if self.test_path is not None:
            if self.source != "file":
                raise ValueError("data.test_path is for data.source 'file' (the hub has data.test_split)")
            if not self.test_path.is_file():
                raise ValueError(f"data.test_path: no such file: {self.test_path}")
        if self.source == "wordnet" and self.group_column not in (None, "pos", "lexname"):
            raise ValueError(
                "data.group_column: the WordNet corpus has two group columns, 'pos' (part of speech) and "
                "'lexname' (lexicographer category: one client per domain)"
            )
        ner = self.task == "token_classification"
        conll_tasks = ("token_classification", "classification")
        if (self.source == "conll2003" and self.task not in conll_tasks) or (
            self.source == "wordnet" and ner
        ):
            raise ValueError(
                f"data.source {self.source} with data.task {self.task}: the built-in NER corpus is "
                "conll2003 (task token_classification, or classification by a sentence's most frequent "
                "entity type); wordnet is for classification, causal_lm and extractive_qa"
            )
        if self.silos is not None:
            if self.task != "classification":
                raise ValueError(
                    f"data.silos: the cross-silo multi-task setting is for classification, not {self.task}"
                )
            if not self.silos:
                raise ValueError("data.silos: give at least one silo")
            names = [silo.name for silo in self.silos]
            if len(set(names)) < len(names):
                raise ValueError(f"data.silos: silo names must be unique, got {names}")
            for i, silo in enumerate(self.silos):
                if silo.silos is not None:
                    raise ValueError(f"data.silos.{i}.silos: a silo cannot hold silos")
        room = self.max_length - self.max_length // 3 - 3  # a window: question (a third at most), 3 specials
        if self.task == "extractive_qa" and self.stride >= room:
            raise ValueError(
                f"data.stride {self.stride}: a window of data.max_length {self.max_length} tokens has room "
                f"for {room} context tokens (the question takes up to a third), and the stride must be less"
            )
        if self.source == "hub" and not self.hub_id:
            raise ValueError("data.hub_id is required when data.source is 'hub'")
        return self

    def unset_is_a_setting(self) -> set[str]:
        """The fields whose being left unset is itself a setting: ``label_column`` (causal
        LM and QA: without it, one domain; named, the column must exist)."""
        return {"label_column"}

    @model_serializer(mode="wrap")
    def _as_given(self, handler):
        """Every field, as resolved, but those of :meth:`unset_is_a_setting` that were left
        unset: a dumped config (``output_dir/config.yaml``, what a deployment sends its
        clients, a sweep's variants) then means the same when it is read back."""
        unset = self.unset_is_a_setting() - self.model_fields_set
        return {k: v for k, v in handler(self).items() if k not in unset}

    @property
    def group_by(self) -> str | None:
        """The column whose values group the examples (``partition.scheme`` groups): data.group_column,
        else WordNet's part of speech ``pos`` (except for extractive_qa, whose WordNet set has
        none), else None."""
        wordnet = self.source == "wordnet" and self.task != "extractive_qa"
        return self.group_column or ("pos" if wordnet else None)


class SiloConfig(DataConfig):
    """One client's own data set in the cross-silo multi-task setting (``data.silos``)."""

    name: str = Field(description="The silo's name: its classes are reported as '<name>:<class>'.")

    def unset_is_a_setting(self) -> set[str]:
        """Every field but the name: what a silo leaves unset it takes from the top-level
        data config (:meth:`resolved`)."""
        return set(type(self).model_fields) - {"name"}

    def resolved(self, defaults: DataConfig) -> DataConfig:
        """This silo's data config: its own settings over ``defaults`` (the top-level data
        config), all of its examples (no subsampling or test share: the silo setting splits them)."""
        own = self.model_dump(include=self.model_fields_set - {"name"})
        base = defaults.model_dump(exclude={"silos", "silo_size"})
        return DataConfig(**{**base, **own, "max_samples": None, "max_test_samples": None})


DataConfig.model_rebuild()


class PartitionConfig(BaseModel):
    """How the training pool is split across clients (all seeded)."""

    model_config = Strict

    scheme: Literal["iid", "dirichlet", "similarity", "natural", "groups"] = Field(
        "dirichlet",
        description="iid; dirichlet (label skew, alpha); similarity (SCAFFOLD s); natural (one client per "
        "value of data.group_column); groups (the C2A paper's language partition: clients divided into "
        "groups, one per value of data.group_column, and each group's examples split among its clients "
        "by the Dirichlet label skew: alpha, dirichlet_mode, min_size).",
    )
    num_clients: int = Field(30, ge=1, description="M, the number of clients.")
    alpha: float = Field(0.5, gt=0, description="Dirichlet concentration (schemes dirichlet, groups).")
    dirichlet_mode: Literal["per_class", "per_class_capped", "per_client"] = Field(
        "per_class",
        description="What the Dirichlet draws (scheme: dirichlet): per_class, each class's split over "
        "clients; per_class_capped, the same but clients above the mean size get no more (FedNLP, "
        "followed by C2A); per_client, each client's class mix Dir(alpha * class shares) at equal "
        "client sizes (FeDeRA, App. A.3).",
    )
    clients_per_group: Literal["equal", "proportional"] = Field(
        "equal",
        description="scheme groups: how the clients are divided among the groups; equal, M // G each and "
        "the M % G left over one each to the largest groups (C2A: 100 clients, 5 languages, 20 each); "
        "proportional, one each and the rest in proportion to the groups' sizes. A group's clients are "
        "consecutive ids, groups in order of first appearance in the data.",
    )
    similarity: float = Field(
        0.5, ge=0, le=1, description="SCAFFOLD heterogeneity s; 0 is iid, 1 label-sorted."
    )
    min_size: int = Field(10, ge=1, description="Smallest client size (schemes dirichlet, groups).")
    local_test_fraction: float = Field(
        0.2, gt=0, lt=1, description="Share of each client's data kept as its local test split."
    )
    val_fraction: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Share of each client's data kept as its validation split, scored as 'val' (0: none; "
        "with data.silos 0.2 unless set: the FedMCP setting's 6:2:2).",
    )

    @model_validator(mode="after")
    def _fractions(self) -> PartitionConfig:
        if self.val_fraction + self.local_test_fraction >= 1:
            raise ValueError(
                f"partition.val_fraction {self.val_fraction} + partition.local_test_fraction "
                f"{self.local_test_fraction} leave no training examples"
            )
        return self
