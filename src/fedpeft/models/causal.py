"""The causal-LM task model: a frozen decoder with its own LM head, trained on responses.

:class:`CausalLM` has the interface of :class:`fedpeft.models.backbone.TaskModel`
(``forward(input_ids, attention_mask)``, ``loss(outputs, batch)``, ``precision``), so
methods and engines train it the same way; its outputs are next-token logits
``(B, L, V)`` and its loss is the cross-entropy of each response token given the tokens
before it. The LM head (often tied to the input embeddings) stays frozen: there is no
new head, and a method's ``head.*`` options find nothing to share or keep.

Generation (:func:`generate`) runs the wrapped Hugging Face model's ``generate`` with
its KV cache, on prompts padded on the left.
"""

from __future__ import annotations

import torch
from torch import nn

from fedpeft.data.task import IGNORE, Encoded, make_batch
from fedpeft.models.masks import additive_mask


class CausalLM(nn.Module):
    """A ``*ForCausalLM`` model as a task model (see the module docstring)."""

    causal = True

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.precision: torch.dtype | None = None
        for p in self.backbone.parameters():
            p.requires_grad_(False)

    def attention_bias(self, attention_mask: torch.Tensor) -> torch.Tensor:
        return additive_mask(attention_mask, True, self.precision or torch.float32)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **_: object) -> torch.Tensor:
        """Next-token logits ``(B, L, V)``, float32."""
        device = next(self.backbone.parameters()).device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        bias = self.attention_bias(attention_mask)
        if self.precision is None:
            return self.backbone(input_ids=input_ids, attention_mask=bias).logits.float()
        with torch.autocast(device.type, dtype=self.precision):
            logits = self.backbone(input_ids=input_ids, attention_mask=bias).logits
        return logits.float()

    @staticmethod
    def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each position's next-token cross-entropy and whether it counts: position ``t``
        predicts token ``t + 1``, which counts when it is labelled (a response token).
        Both ``(B, L - 1)``."""
        target = labels[:, 1:]
        counted = target != IGNORE
        losses = nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), target.clamp_min(0).flatten(), reduction="none"
        ).view(target.shape)
        return losses * counted, counted

    def loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy over the response tokens of the batch's real rows."""
        losses, counted = self.token_losses(logits, batch["labels"])
        weight = batch["weight"].unsqueeze(1) if "weight" in batch else 1.0
        return (losses * weight).sum() / (counted * weight).sum().clamp_min(1.0)


@torch.no_grad()
def response_nll(model: CausalLM, data: Encoded, batch_size: int) -> tuple[float, int]:
    """The summed negative log-likelihood of ``data``'s response tokens under ``model``
    (as loaded) and their count: perplexity is ``exp(nll / count)``."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(data), batch_size):
        batch = make_batch(data, torch.arange(start, min(start + batch_size, len(data))))
        losses, counted = model.token_losses(
            model(**batch), batch["labels"].to(next(model.parameters()).device)
        )
        total += float(losses.sum())
        count += int(counted.sum())
    return total, count


def prompts_of(data: Encoded, rows: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts of ``rows`` padded on the left (generation appends on the right):
    ids and attention mask, ``(B, longest prompt)``."""
    lengths = data.prompt_lengths[rows]
    width = int(lengths.max())
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=data.ids.device)
    mask = torch.zeros_like(ids)
    for k, (row, n) in enumerate(zip(rows.tolist(), lengths.tolist(), strict=True)):
        ids[k, width - n :] = data.ids[row, :n]
        mask[k, width - n :] = 1
    return ids, mask


def references_of(data: Encoded, tokenizer) -> list[str]:
    """Each example's response as text (its labelled tokens, special tokens dropped)."""
    return [
        tokenizer.decode(row[row != IGNORE].tolist(), skip_special_tokens=True).strip() for row in data.labels
    ]


@torch.no_grad()
def generate(model: CausalLM, data: Encoded, tokenizer, options, batch_size: int) -> list[str]:
    """The model's (as loaded) response to each prompt of ``data``, decoded.

    ``options`` (``fedpeft.config.GenerationConfig``): ``strategy`` greedy, beam
    (``num_beams``) or sample (``temperature``, ``top_p``, seeded by ``seed``), at most
    ``max_new_tokens`` new tokens; Hugging Face's ``generate`` with its KV cache."""
    model.eval()
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    kwargs = {
        "max_new_tokens": options.max_new_tokens,
        "pad_token_id": pad_id,
        "eos_token_id": tokenizer.eos_token_id,
        "do_sample": options.strategy == "sample",
        "num_beams": options.num_beams if options.strategy == "beam" else 1,
        **(
            {"temperature": options.temperature, "top_p": options.top_p}
            if options.strategy == "sample"
            else {}
        ),
    }
    texts: list[str] = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(options.seed)
        for start in range(0, len(data), batch_size):
            ids, mask = prompts_of(data, torch.arange(start, min(start + batch_size, len(data))), pad_id)
            ids, mask = ids.to(device), mask.to(device)
            with torch.autocast(device.type, dtype=model.precision, enabled=model.precision is not None):
                out = model.backbone.generate(input_ids=ids, attention_mask=mask, **kwargs)
            texts += [
                t.strip() for t in tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
            ]
    return texts
