"""LoRA via HF PEFT: ``h = W0 x + (alpha / r) B A x`` on the target projections.

Thin on purpose: HF PEFT's LoRA layer already implements the formula with
``A`` random (Kaiming-uniform) and ``B = 0``, so the model starts at the pretrained one.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from fedpeft.config.methods.specs import LoraSpec

#: The attention's query and value projections (the papers' ``query``/``value``) in each
#: family fedpeft has checked (tests/models/test_decoder_families.py builds a tiny one of each);
#: a fused projection (Phi-3's ``qkv_proj``, GPT-2's ``c_attn``) is adapted whole.
QUERY_VALUE = {
    **dict.fromkeys(
        ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi"),
        ["q_proj", "v_proj"],
    ),
    "phi3": ["qkv_proj"],
    "gpt2": ["c_attn"],
    "distilbert": ["q_lin", "v_lin"],
    **dict.fromkeys(("bert", "roberta", "xlm-roberta", "electra"), ["query", "value"]),
}


def default_targets(model_type: str, targets: list[str]) -> list[str] | str:
    """The modules to adapt: ``["query", "value"]`` (the default, the papers' choice) names
    the attention's query and value projections, whatever a family calls them
    (:data:`QUERY_VALUE`, else HF PEFT's own table of default targets); ``["all-linear"]``
    every linear layer but the output head (PEFT's ``all-linear``); other names as given."""
    if targets == ["all-linear"]:
        return "all-linear"
    if targets != ["query", "value"]:
        return targets
    if model_type in QUERY_VALUE:
        return QUERY_VALUE[model_type]
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

    if model_type in PEFT_DEFAULTS:
        return list(PEFT_DEFAULTS[model_type])
    raise ValueError(
        f"method.lora.target_modules: which modules of a {model_type!r} model are its query and value is "
        "not known here; name them (e.g. [q_proj, v_proj]) or use [all-linear]"
    )


def add_lora(backbone: nn.Module, spec: LoraSpec) -> nn.Module:
    """The backbone wrapped as a ``peft.PeftModel`` with LoRA on ``spec.target_modules``."""
    from peft import LoraConfig, get_peft_model

    targets = default_targets(getattr(backbone.config, "model_type", ""), spec.target_modules)
    config = LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=targets,
        use_dora=spec.use_dora,
    )
    try:
        return get_peft_model(backbone, config)
    except ValueError as err:
        raise ValueError(f"method.lora.target_modules {targets}: {err}") from err


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """``{module name: PEFT LoRA layer}`` for every LoRA-adapted linear of ``model``."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


#: One additive term ``scale * B @ A`` of an adapted weight: ``(scale, A (r, in), B (out, r))``.
LoraTerm = tuple[float, torch.Tensor, torch.Tensor]


def write_lora_adapter(
    config, terms: dict[str, list[LoraTerm]], out_dir: Path, magnitudes: dict[str, torch.Tensor] | None = None
) -> None:
    """Write one HF PEFT LoRA adapter whose update of module ``m`` is ``sum_k s_k B_k A_k``
    over ``terms[m]`` (module names as in the TaskModel, ``backbone.`` first).

    The terms are stacked into a single adapter of rank ``r' = sum_k r_k``:
    ``A' = [A_1; A_2; ...]``, ``B' = [B_1, (s_2/s_1) B_2, ...]`` with ``lora_alpha = s_1 r'``,
    so PEFT's scaling ``lora_alpha / r'`` is ``s_1`` and ``s_1 B' A' = sum_k s_k B_k A_k``
    (HF PEFT converts PiSSA adapters the same way). With one term this is the plain
    adapter, rank and scale unchanged. ``config`` is the ``LoraConfig`` the model was
    built with (target modules, dropout); ``PeftModel.from_pretrained`` on the
    *pretrained* backbone then computes exactly the adapted model. ``magnitudes``: DoRA's
    trained magnitude of each module (``use_dora``): DoRA normalises ``W0 + s B' A'``,
    the same matrix as the trained model's, so the same magnitude applies.
    """
    from safetensors.torch import save_file

    state, ranks, base_scale = {}, set(), None
    for module, parts in terms.items():
        base_scale = parts[0][0] if base_scale is None else base_scale
        a = torch.cat([a for _, a, _ in parts], dim=0)
        b = torch.cat([b * (s / base_scale) for s, _, b in parts], dim=1)
        key = module.removeprefix("backbone.")
        state[f"{key}.lora_A.weight"] = a.contiguous()
        state[f"{key}.lora_B.weight"] = b.contiguous()
        if magnitudes is not None:
            state[f"{key}.lora_magnitude_vector"] = magnitudes[module].contiguous()
        ranks.add(a.shape[0])
    if len(ranks) != 1:  # pragma: no cover - every fedpeft method adapts all modules at one rank
        raise ValueError(f"adapted modules have different total ranks {sorted(ranks)}")
    r = ranks.pop()
    out = copy.deepcopy(config)
    out.r, out.lora_alpha, out.rank_pattern, out.alpha_pattern = r, base_scale * r, {}, {}
    out_dir.mkdir(parents=True, exist_ok=True)
    out.save_pretrained(str(out_dir))
    save_file(state, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})


def dora_magnitudes(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """DoRA's magnitude of every adapted module (from ``tensors``, else the model's own),
    or None when the model's LoRA is not DoRA."""
    layers = lora_layers(model)
    if not any(len(layer.lora_magnitude_vector) for layer in layers.values()):
        return None
    own = dict(model.named_parameters())
    out = {}
    for name in layers:
        key = f"{name}.lora_magnitude_vector.default.weight"
        out[name] = tensors.get(key, own[key]).detach()
    return out


def full_rank_terms(updates: dict[str, torch.Tensor]) -> dict[str, LoraTerm]:
    """Per module, a dense update ``dW`` as one LoRA term ``(1, V^T, U S)`` of rank
    ``min(d_out, d_in)`` (its SVD), zero-padded to one rank for all modules (a PEFT adapter
    has one rank): the frozen-weight changes of FedEx-LoRA and FLoRA, exported on ``W0``."""
    factors = {}
    for name, update in updates.items():
        u, s, vh = torch.linalg.svd(update.double(), full_matrices=False)
        factors[name] = ((u * s).float(), vh.float())
    rank = max(vh.shape[0] for _, vh in factors.values())
    out = {}
    for name, (us, vh) in factors.items():
        pad = rank - vh.shape[0]
        a = torch.cat([vh, vh.new_zeros(pad, vh.shape[1])])
        b = torch.cat([us, us.new_zeros(us.shape[0], pad)], dim=1)
        out[name] = (1.0, a, b)
    return out


def lora_terms(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, list[LoraTerm]]:
    """The ``(scale, A, B)`` terms of every LoRA-adapted module for the adapters whose
    tensors are in ``tensors`` (PEFT parameter names), in the layer's adapter order."""
    terms: dict[str, list[LoraTerm]] = {}
    for name, layer in lora_layers(model).items():
        for adapter in layer.lora_A:
            a = tensors.get(f"{name}.lora_A.{adapter}.weight")
            if a is not None:
                b = tensors[f"{name}.lora_B.{adapter}.weight"]
                terms.setdefault(name, []).append((layer.scaling[adapter], a, b))
    return terms
