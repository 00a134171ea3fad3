"""Soft prompts (prompt tuning, Lester et al., 2021): trainable virtual tokens before the input.

``P`` trainable vectors, HF PEFT's :class:`peft.tuners.prompt_tuning.PromptEmbedding`
(its ``embedding.weight``, ``(P, H)``), are prepended to the token embeddings of every
example; the frozen backbone runs on ``P + L`` positions and only the ``L`` real
positions leave it. So the task model around it (pooling, token and span heads, their
masks and labels) sees exactly the shapes it sees without a prompt: nothing of
:class:`fedpeft.models.backbone.TaskModel` changes, the backbone is wrapped
(:class:`PromptedBackbone`).

Attention: every real token attends every virtual token; a virtual token attends the
other virtual tokens and, in an encoder, the real tokens that are not padding (in a
decoder, which reads left to right, only the virtual tokens before it). Positions: the
virtual tokens take the first ``P`` positions and the input the ``L`` after them, as
in HF PEFT, so ``P + L`` must fit the backbone's position table.
"""

from __future__ import annotations

import torch
from torch import nn

from fedpeft.config.methods.specs import PromptSpec


def extend_bias(bias: torch.Tensor, prompt_len: int, causal: bool) -> torch.Tensor:
    """A prepared additive mask ``(B, 1, L, L)`` (:func:`fedpeft.models.masks.additive_mask`)
    grown to ``(B, 1, P + L, P + L)`` for ``P`` virtual tokens in front (see the module
    docstring for who attends whom). An encoder's mask holds the same key-padding row
    for every query; a virtual token reads it from the first row."""
    batch, _, length, _ = bias.shape
    fill = torch.finfo(bias.dtype).min / 2
    zeros = torch.zeros((), dtype=bias.dtype, device=bias.device)
    if causal:
        later = torch.ones(prompt_len, prompt_len, dtype=torch.bool, device=bias.device).triu(1)
        among = zeros.expand(prompt_len, prompt_len).masked_fill(later, fill)
        to_real = torch.full((1, 1, prompt_len, length), fill, dtype=bias.dtype, device=bias.device)
    else:
        among = zeros.expand(prompt_len, prompt_len)
        to_real = bias[:, :, :1, :]
    top = torch.cat(
        [among.expand(batch, 1, prompt_len, prompt_len), to_real.expand(batch, 1, prompt_len, length)], dim=-1
    )
    bottom = torch.cat([zeros.expand(batch, 1, length, prompt_len), bias], dim=-1)
    return torch.cat([top, bottom], dim=-2)


class PromptedBackbone(nn.Module):
    """A frozen backbone with a soft prompt in front of its input (module docstring).

    Called as the backbone it wraps, ``(input_ids=(B, L), attention_mask=(B, 1, L, L)
    additive)``, it returns that backbone's output with the virtual positions removed:
    ``last_hidden_state`` (and ``logits``, where present) of shape ``(B, L, ...)``."""

    def __init__(self, base: nn.Module, spec: PromptSpec, causal: bool):
        super().__init__()
        from peft import PromptEmbedding, PromptTuningConfig

        self.base = base
        self.causal = causal
        init = "SAMPLE_VOCAB" if spec.init == "sample_vocab" else "RANDOM"
        config = PromptTuningConfig(
            task_type="FEATURE_EXTRACTION",
            num_virtual_tokens=spec.num_virtual_tokens,
            token_dim=base.config.hidden_size,
            num_transformer_submodules=1,
            prompt_tuning_init=init,
        )
        self.prompt = PromptEmbedding(config, base.get_input_embeddings())
        if spec.init == "uniform":
            nn.init.uniform_(self.prompt.embedding.weight, -0.5, 0.5)
        self.prompt.embedding.weight.requires_grad_(True)

    @property
    def config(self):
        """The wrapped backbone's config (what callers read: hidden size, attention kind)."""
        return self.base.config

    @property
    def num_virtual_tokens(self) -> int:
        return self.prompt.embedding.weight.shape[0]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs):
        prompt_len, length = self.num_virtual_tokens, input_ids.shape[1]
        limit = getattr(self.config, "max_position_embeddings", None)
        if limit is not None and prompt_len + length > limit:
            raise ValueError(
                f"prompt tuning: {prompt_len} virtual tokens + {length} input tokens exceed the backbone's "
                f"{limit} positions; lower data.max_length or method.prompt.num_virtual_tokens"
            )
        embeds = self.base.get_input_embeddings()(input_ids)  # (B, L, H)
        prompt = self.prompt.embedding.weight.to(embeds.dtype)  # (P, H)
        inputs = torch.cat([prompt.unsqueeze(0).expand(embeds.shape[0], -1, -1), embeds], dim=1)
        bias = extend_bias(attention_mask, prompt_len, self.causal)  # (B, 1, P + L, P + L)
        out = self.base(inputs_embeds=inputs, attention_mask=bias, **kwargs)
        fields = {k: out[k][:, prompt_len:] for k in ("last_hidden_state", "logits") if k in out}
        return type(out)(**fields)
