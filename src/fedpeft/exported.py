"""Load what a run exported back into the model it trained, and predict with it.

A run writes its global model to ``output_dir/adapter/`` and, with ``export.personal``,
each client's own model to ``adapter/clients/<cid>/`` (:func:`fedpeft.experiment.export`).
Each directory is self-contained: its ``fedpeft_model.json`` carries the run's resolved
config, from which :func:`load_export` rebuilds the task model as the run built it (the
backbone, the seeded head, the method's own modules: :func:`fedpeft.experiment.attach_method`)
and then puts the exported tensors in place:

- ``trainable.safetensors`` (every method that does not train LoRA): the tensors under
  their names in that model; a client's export holds its whole model (every trainable
  tensor, as :meth:`Method.eval_state` combines them), the global export the shared
  tensors, completed as the engine scores the global model (:meth:`Method.global_state`);
- an HF PEFT adapter (LoRA methods): ``PeftModel.from_pretrained`` on the pretrained
  backbone, plus the head from ``head.safetensors``, as the README loads it by hand.

Predictions run the model's forward pass in eval mode in the run's precision, the path
of fedpeft's own evaluation (:func:`fedpeft.metrics.classification.logits`), so each
method's inference behaviour is the one its modules have in training: C2A's uniform label
distribution, AdaMix's averaged experts, a soft prompt's virtual tokens, FedMCP's two
adapters. Anything wrong with a directory (a missing or corrupt file, a tensor the model
built from the config has not, or of another shape) is an :class:`ExportError` naming
the file and the tensor.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fedpeft.config import ExperimentConfig, parse_config
from fedpeft.config.io import read_text, read_yaml
from fedpeft.data.task import Encoded, encode
from fedpeft.metrics.classification import logits as model_logits

INFO = "fedpeft_model.json"
TENSORS = "trainable.safetensors"
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
HEAD = "head.safetensors"


class ExportError(ValueError):
    """An export directory that does not load; the message names the file and the tensor."""


@dataclass
class ExportedModel:
    """A loaded export: the task model (eval mode, on its device), its tokenizer, the run's
    config and ``fedpeft_model.json``. ``filled``: trainable tensors the export does not
    hold, left at their values before training (only with ``load_export(partial=True)``)."""

    model: torch.nn.Module
    tokenizer: object
    config: ExperimentConfig
    info: dict
    path: Path
    filled: list[str] = field(default_factory=list)

    @property
    def labels(self) -> list[str]:
        """The class names, in the order of the logits' columns."""
        id2label = self.info.get("id2label", {})
        return [id2label[str(i)] for i in range(len(id2label))]

    def encode(self, texts: Sequence[str]) -> Encoded:
        """``texts`` tokenised as the run tokenised its data (truncated at ``data.max_length``)."""
        self._classification_only("ExportedModel.encode")
        data = encode(list(texts), np.zeros(len(texts)), self.tokenizer, self.config.data.max_length)
        return data.to(next(self.model.parameters()).device)

    def logits(self, texts: Sequence[str], batch_size: int | None = None) -> torch.Tensor:
        """``(N, C)`` float32 logits of ``texts`` on the CPU, computed as fedpeft's evaluation
        computes them (batches of ``eval.batch_size`` rows and ``eval.batch_tokens`` tokens,
        each padded to its longest text)."""
        data = self.encode(texts)
        ev = self.config.eval
        return model_logits(self.model, data, batch_size or ev.batch_size, ev.batch_tokens)

    def predict(self, texts: Sequence[str], batch_size: int | None = None) -> list[str]:
        """The predicted class name of each text."""
        labels = self.labels
        return [labels[i] for i in self.logits(texts, batch_size).argmax(-1).tolist()] if texts else []

    def _classification_only(self, what: str) -> None:
        task = self.config.data.task
        if task != "classification":
            raise ValueError(
                f"{what}: texts -> logits is for classification exports, and {self.path} holds a model "
                f"of data.task {task}: call .model on batches encoded as fedpeft encodes that task "
                "(fedpeft.data)"
            )


def load_export(
    path: str | Path,
    device: str = "cpu",
    *,
    precision: str | None = None,
    backbone: str | None = None,
    partial: bool = False,
) -> ExportedModel:
    """The model an export directory holds (``runs/<name>/adapter`` or
    ``runs/<name>/adapter/clients/<cid>``), rebuilt from the config it carries, on
    ``device`` (``cpu``, ``cuda``, ``auto``...), in eval mode.

    ``precision``: ``fp32``, ``bf16`` or ``fp16`` (default: the run's ``train.precision``,
    the precision its scores were computed in). ``backbone``: where the pretrained backbone
    is now, when the run's ``model.backbone`` path no longer holds it. ``partial``: accept a
    global export that is not a whole model (the run kept part of every model personal, so
    it has no single global model; e.g. a personal head), the missing tensors left at their
    values before training (listed in ``filled``); without it such an export is an error.
    """
    from fedpeft.experiment import place
    from fedpeft.models.device import PRECISIONS
    from fedpeft.optional import bitsandbytes_unless

    d = Path(path)
    info = read_info(d)
    cfg = export_config(d, info, backbone)
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    fork = torch.random.fork_rng(devices=[])  # the build seeds torch: leave the caller's stream alone
    with fork, bitsandbytes_unless(cfg.model.quantization != "none"):
        if (d / TENSORS).is_file() or not (d / PEFT_CONFIG).is_file():
            model, tokenizer, filled = load_tensors_export(d, cfg, info)
        else:
            model, tokenizer, filled = load_peft_export(d, cfg, info)
    if filled and not partial:
        raise ExportError(
            f"{d}: not a whole model: it lacks {filled[0]!r}"
            + (f" and {len(filled) - 1} more tensor(s)" if len(filled) > 1 else "")
            + f", which method {cfg.method.name} keeps on each client (the run has no single global "
            "model). Load a client's export (adapter/clients/<cid>, written with export.personal), "
            "or pass partial=True to leave them at their values before training"
        )
    train = cfg.train.model_copy(update={"device": device, "precision": precision or cfg.train.precision})
    place(model, train)  # as the run placed it: frozen weights in the precision, trained ones float32
    for p in model.parameters():
        p.requires_grad_(False)
    return ExportedModel(model.eval(), tokenizer, cfg, info, d, filled)


# ---------------------------------------------------------------- the directory


def read_info(d: Path) -> dict:
    """``fedpeft_model.json`` of export directory ``d``."""
    if not d.is_dir():
        raise ExportError(f"{d}: no such export directory")
    file = d / INFO
    if not file.is_file():
        raise ExportError(
            f"{file}: missing: {d} is not a fedpeft export (runs/<name>/adapter or adapter/clients/<cid>)"
        )
    try:
        info = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ExportError(f"{file}: not valid JSON ({err})") from None
    if not isinstance(info, dict):
        raise ExportError(f"{file}: expected a JSON object")
    return info


def part_of(d: Path, info: dict) -> str:
    """``global`` or ``client``: which model the directory holds."""
    return info.get("part") or ("client" if d.parent.name == "clients" else "global")


def export_config(d: Path, info: dict, backbone: str | None) -> ExperimentConfig:
    """The run's config: from ``fedpeft_model.json`` or, for an export written before it
    carried one, the run directory's ``config.yaml`` beside it."""
    if "config" in info:
        cfg = parse_config(info["config"], f"{d / INFO}: config")
    else:
        run_dir = d.parents[2] if part_of(d, info) == "client" else d.parent
        file = run_dir / "config.yaml"
        if not file.is_file():
            raise ExportError(
                f"{d / INFO}: holds no 'config' (written by an earlier fedpeft) and the run's "
                f"{file} is not there either: copy the run's config.yaml to {file}"
            )
        cfg = parse_config(read_yaml(read_text(file, "config"), f"config {file}"), str(file))
    if backbone is not None:
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"backbone": str(backbone)})})
    return cfg


def read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not file.is_file():
        raise ExportError(f"{file}: missing")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as err:
        raise ExportError(f"{file}: not a readable safetensors file ({err})") from None


def check_tensors(
    file: Path, tensors: dict[str, torch.Tensor], params: dict, wanted: set[str], what: str
) -> None:
    """Every tensor of ``file`` names a tensor of ``params`` with its shape, and the file
    holds every one of ``wanted``."""
    for name, value in tensors.items():
        if name not in params:
            raise ExportError(f"{file}: tensor {name!r} names no trainable tensor of {what}")
        if tuple(value.shape) != tuple(params[name].shape):
            raise ExportError(
                f"{file}: tensor {name!r} has shape {tuple(value.shape)}, but in {what} it has "
                f"{tuple(params[name].shape)}"
            )
    if missing := sorted(wanted - set(tensors)):
        raise ExportError(f"{file}: lacks tensor {missing[0]!r} of {what} ({len(missing)} missing)")


def num_outputs(info: dict, cfg: ExperimentConfig) -> int:
    if cfg.data.task in ("classification", "token_classification"):
        if not info.get("id2label"):
            raise ExportError(f"{INFO}: a {cfg.data.task} export needs 'id2label' (the class names)")
        return len(info["id2label"])
    return 2  # extractive QA's (start, end); a causal LM has no head


# ---------------------------------------------------------------- the two formats


def load_tensors_export(d: Path, cfg: ExperimentConfig, info: dict):
    """``trainable.safetensors`` into the model the method prepares."""
    from fedpeft.experiment import attach_method
    from fedpeft.methods.base import ServerState, load_tensors
    from fedpeft.models.backbone import build_model

    model, tokenizer = build_model(cfg.model, num_outputs(info, cfg), cfg.seed, cfg.data.task)
    method, _ = attach_method(cfg, model)
    file = d / TENSORS
    tensors = read_safetensors(file)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    what = f"the {method.name} model built from the export's config"
    if part_of(d, info) == "client":  # a client's whole model
        check_tensors(file, tensors, params, set(params), what)
        state = tensors
    else:  # the shared tensors, completed as the engine scores the global model
        check_tensors(file, tensors, params, set(method.shared_names), what)
        state = method.global_state(ServerState(dict(tensors))) or tensors
    load_tensors(model, state)
    return model, tokenizer, sorted(set(params) - set(state))


def load_peft_export(d: Path, cfg: ExperimentConfig, info: dict):
    """An HF PEFT LoRA adapter onto the pretrained backbone, and the head."""
    from peft import PeftModel

    from fedpeft.methods.base import load_tensors
    from fedpeft.models.backbone import build_model

    model, tokenizer = build_model(cfg.model, num_outputs(info, cfg), cfg.seed, cfg.data.task)
    weights = d / PEFT_WEIGHTS
    saved = read_safetensors(weights)
    try:
        model.backbone = PeftModel.from_pretrained(model.backbone, str(d))
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        raise ExportError(
            f"{weights}: the HF PEFT adapter (with its {PEFT_CONFIG}) does not load onto backbone "
            f"{cfg.model.backbone!r}: {err}"
        ) from None
    lora = {n: p for n, p in model.backbone.named_parameters() if "lora_" in n}
    # the file names each tensor as PEFT saves it: without the adapter's name ("default"),
    # DoRA's magnitude without its ".default.weight"
    params = {n.replace(".lora_magnitude_vector.default.weight", ".lora_magnitude_vector").replace(
        ".default.", "."): p for n, p in lora.items()}  # fmt: skip
    check_tensors(weights, saved, params, set(params), "the LoRA model of its adapter_config.json")
    trained = [*lora.values()]
    filled = []
    head = getattr(model, "head", None)
    if head is not None:
        if (d / HEAD).is_file():
            file = d / HEAD
            values = read_safetensors(file)
            head_params = dict(head.named_parameters())
            check_tensors(file, values, head_params, set(head_params), "the classification head")
            load_tensors(head, values)
        else:  # a personal head stays out of the global export
            filled = [f"head.{n}" for n, _ in head.named_parameters()]
        trained += [*head.parameters()]
    for p in trained:  # trained tensors stay float32 under a lower precision, as in the run
        p.requires_grad_(True)
    return model, tokenizer, filled
