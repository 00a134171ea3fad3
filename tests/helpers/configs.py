"""Configs shared by test modules: the tiny experiment (``tests/conftest.py``'s
``tiny_config`` builds on it), method and run settings several modules use, and the
tasks' seconds-long configs."""

from __future__ import annotations

TINY = {
    "name": "tiny",
    "seed": 3,
    "data": {"source": "wordnet", "max_samples": 300, "max_test_samples": 60, "max_length": 16},
    "partition": {"scheme": "dirichlet", "num_clients": 4, "alpha": 0.5, "min_size": 10},
    "train": {"rounds": 2, "clients_per_round": 2, "local_steps": 2, "batch_size": 8, "lr": 0.01},
    "eval": {"every": 1, "batch_size": 64},
    "log": {"plots": False},  # drawing a tiny run's figures takes longer than training it
}


#: A chat template for the tiny decoder (its tokenizer, MiniLM's, has none).
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} [SEP] {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


#: Fed-SB at rank 4 (s = 1, as the authors' alpha = r), its setup over 12 examples a round
FEDSB = {"name": "fedsb", "lora": {"r": 4, "alpha": 4}, "init_samples": 12}


PF2 = {"name": "pf2lora", "lora": {"r": 4, "alpha": 8}, "client_rank": 2, "client_alpha": 4}


#: user-level DP (a fixed noise multiplier: no calibration to wait for)
USER_DP = {"privacy": {"mode": "user", "noise_multiplier": 0.7, "clip": 0.05}}

SCAFFOLD = {"train.correction": "scaffold", "train.optimizer": "sgd", "train.lr": 0.05}


def task_config(task, tiny_config, tiny_decoder, tmp_path, out, **over):
    """A seconds-long config of ``task`` (the task tests' own) writing to ``out``."""
    over = {"train.rounds": 2, "output_dir": str(out), **over}
    if task == "causal_lm":
        return lm_config(tiny_config, tiny_decoder, **over)
    if task == "token_classification":
        return ner_config(tiny_config, write_conll(tmp_path / "train.conll", SENTENCES * 20), **over)
    return tiny_config(**{"data.task": "extractive_qa", "data.max_length": 48, "data.stride": 16,
                          "data.max_samples": 120, "data.max_test_samples": 20, **over})  # fmt: skip


SMALL = {
    "partition.num_clients": 3,
    "train.clients_per_round": 3,
    "train.threads": 1,
    "train.rounds": 2,
    "eval.every": 2,
}


#: methods whose clients train different ranks (``method.ranks``) masked in one cohort
MIXED_RANKS = {"flexlora": {"ranks": [2, 8, 4]}, "flora": {"ranks": [2, 8, 4]}}


def lm_config(tiny_config, tiny_decoder, **over):
    return tiny_config(
        **{
            "model.backbone": str(tiny_decoder),
            "data.task": "causal_lm",
            "data.max_length": 32,
            "data.max_samples": 120,
            "data.max_test_samples": 12,
            "eval.generation.max_new_tokens": 6,
            "eval.generation.samples": 4,
            "train.lr": 0.02,
            "train.local_steps": 4,
            "train.rounds": 3,
            **over,
        }
    )


SENTENCES = [
    (["EU", "rejects", "German", "call"], ["B-ORG", "O", "B-MISC", "O"]),
    (["Peter", "Blackburn", "visited", "Brussels"], ["B-PER", "I-PER", "O", "B-LOC"]),
    (["It", "rained"], ["O", "O"]),
]


def write_conll(path, sentences, docstart=True):
    lines = ["-DOCSTART- -X- -X- O", ""] if docstart else []
    for words, tags in sentences:
        lines += [f"{w} NN O {t}" for w, t in zip(words, tags, strict=True)] + [""]
    path.write_text("\n".join(lines) + "\n")
    return path


def ner_config(tiny_config, path, **over):
    return tiny_config(
        **{
            "data": {"task": "token_classification", "source": "file", "path": str(path), "max_length": 24},
            "partition.num_clients": 3,
            "partition.min_size": 2,
            "train.local_steps": 3,
            **over,
        }
    )
