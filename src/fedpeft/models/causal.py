"""The causal-LM task model: a frozen decoder with its own LM head, trained on responses.

:class:`CausalLM` has the interface of :class:`fedpeft.models.backbone.TaskModel`
(``forward(input_ids, attention_mask)``, ``loss(outputs, batch)``, ``precision``), so
methods and engines train it the same way; its loss is the cross-entropy of each
response token given the tokens before it. The LM head (often tied to the input
embeddings) stays frozen: there is no new head, and a method's ``head.*`` options find
nothing to share or keep.

The LM head runs where a label is scored. Its logits are the biggest tensor of a step
(``(B, L, V)``, 49,152 per position for SmolLM2), while only response tokens (often a
tenth of the positions) are trained on or scored. A batch that names its scored positions
(:data:`SCORED`, added by :meth:`CausalLM.prepare_batch` outside ``vmap``, since how many
there are depends on the data) gets logits ``(K, V)`` at those only: the decoder's
hidden states are gathered there, then the head applied. The loss is the same to float
rounding; without :data:`SCORED` the forward pass returns every position's logits.

Generation (:func:`generate`) runs the wrapped Hugging Face model's ``generate`` with
its KV cache, on prompts padded on the left.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from fedpeft.data.task import IGNORE, WHOLE, Encoded, Part, eval_batches, make_batch, share_of
from fedpeft.models.masks import additive_mask

#: Positions per LM-head call when scoring without gradients: its logits, ``(chunk, V)``,
#: are the only ones held at a time (:meth:`CausalLM.scored_nll`).
HEAD_CHUNK = 1024

#: A batch entry: the positions whose next token is scored, as flat indices into the
#: batch's ``rows x tokens`` positions, first to last, ``(K,)`` (a cohort's batch:
#: ``(C, K)``, K the most of any client), padded with ``-1`` (:func:`scored_positions`).
SCORED = "scored"


def scored_positions(labels: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """The :data:`SCORED` entry of token labels ``(..., B, L)``: position ``t`` of row
    ``b`` (flat index ``b * L + t``) counts when token ``t + 1`` is labelled. ``(..., K)``;
    K, the most scored positions of any leading index (at least 1), depends on the data,
    so this runs outside ``vmap``; given ``k`` (K worked out on the CPU beforehand:
    :func:`scored_counts`), nothing here waits for the device."""
    follows = labels[..., 1:] != IGNORE
    counted = torch.cat([follows, torch.zeros_like(follows[..., :1])], -1).flatten(-2)  # (..., B * L)
    counts = counted.sum(-1, keepdim=True)
    if k is None:
        k = max(int(counts.max()), 1) if counts.numel() else 1
    first = torch.argsort((~counted).to(torch.uint8), dim=-1, stable=True)[..., :k]  # scored first, in order
    return torch.where(torch.arange(k, device=labels.device) < counts, first, -1)


def scored_counts(labels: torch.Tensor) -> torch.Tensor:
    """How many :data:`SCORED` positions each row of token labels ``(N, L)`` has: its
    labelled tokens after the first position (a row's padding is :data:`IGNORE`)."""
    return (labels[:, 1:] != IGNORE).sum(1)


def with_scored(batch: dict[str, torch.Tensor], k: int | None = None) -> dict[str, torch.Tensor]:
    """``batch`` with its :data:`SCORED` positions (``k``: their count, if known)."""
    return {**batch, SCORED: scored_positions(batch["labels"], k)}


def scored_weight(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """How much each :data:`SCORED` position counts ``(K,)``: its row's weight (a cohort's
    padded rows weigh 0), 0 for padding."""
    scored = batch[SCORED]
    weight = (scored >= 0).float()
    if "weight" in batch:
        row = scored.clamp_min(0) // batch["labels"].shape[-1]
        weight = weight * batch["weight"].gather(0, row)
    return weight


def scored_targets(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The token each :data:`SCORED` position predicts ``(K,)`` (any token for padding)."""
    return batch["labels"].flatten().gather(0, batch[SCORED].clamp_min(0) + 1).clamp_min(0)


def scored_losses(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The next-token cross-entropy at each :data:`SCORED` position of ``batch``, from the
    logits ``(K, V)`` there, and how much each counts (:func:`scored_weight`); both ``(K,)``."""
    losses = nn.functional.cross_entropy(logits, scored_targets(batch), reduction="none")
    return losses, scored_weight(batch)


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

    @staticmethod
    def prepare_batch(batch: dict[str, torch.Tensor], scored: int | None = None) -> dict[str, torch.Tensor]:
        """What a training step adds to a batch outside ``vmap``: its :data:`SCORED`
        positions (``scored``: how many, when the caller worked it out)."""
        return with_scored(batch, scored)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        scored: torch.Tensor | None = None,
        **_: object,
    ) -> torch.Tensor:
        """Next-token logits, float32: ``(B, L, V)``, or with ``scored`` (:data:`SCORED`,
        ``(K,)``) ``(K, V)`` at those positions only."""
        device = next(self.backbone.parameters()).device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        bias = self.attention_bias(attention_mask)
        with self.autocast(device):
            if scored is None:
                logits = self.backbone(input_ids=input_ids, attention_mask=bias, use_cache=False).logits
            else:
                logits = self.logits_at(input_ids, bias, scored.to(device).clamp_min(0))
        return logits.float()

    def autocast(self, device: torch.device):
        """Autocast to ``precision``, or nothing."""
        if self.precision is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.precision)

    def split_head(self) -> tuple[nn.Module, nn.Module] | None:
        """The decoder and the LM head, when the logits are the head applied to the
        decoder's last hidden states; None for a model that transforms them further
        (Gemma's soft-capping, Cohere's scale) or whose parts are not found."""
        lm = self.backbone.get_base_model() if hasattr(self.backbone, "get_base_model") else self.backbone
        decoder, head, config = lm.get_decoder(), lm.get_output_embeddings(), lm.config
        if decoder is lm or head is None:
            return None
        if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
            return None
        return decoder, head

    def logits_at(self, input_ids: torch.Tensor, bias: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The logits at flat ``positions`` ``(K,)`` of the batch ``(K, V)``: the decoder's
        hidden states gathered there, then the LM head (:meth:`split_head`; else the whole
        model's logits, gathered)."""
        split = self.split_head()
        if split is None:
            logits = self.backbone(input_ids=input_ids, attention_mask=bias, use_cache=False).logits
            return logits.flatten(0, 1).index_select(0, positions)
        decoder, head = split
        return head(self.hidden_at(decoder, input_ids, bias, positions))

    @staticmethod
    def hidden_at(
        decoder: nn.Module, input_ids: torch.Tensor, bias: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The decoder's last hidden states at flat ``positions`` ``(K, H)``."""
        hidden = decoder(input_ids=input_ids, attention_mask=bias, use_cache=False).last_hidden_state
        return hidden.flatten(0, 1).index_select(0, positions)  # (B, L, H) -> (K, H)

    @torch.no_grad()
    def scored_nll(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`scored_losses` of ``batch`` (with its :data:`SCORED` positions) for scoring:
        the LM head applied to :data:`HEAD_CHUNK` positions at a time, so that a batch of
        many responses never holds all their logits at once."""
        split = self.split_head()
        if split is None:
            return scored_losses(
                self(batch["input_ids"], batch["attention_mask"], scored=batch[SCORED]), batch
            )
        decoder, head = split
        device = next(self.backbone.parameters()).device
        bias = self.attention_bias(batch["attention_mask"].to(device))
        positions = batch[SCORED].to(device).clamp_min(0)
        with self.autocast(device):
            hidden = self.hidden_at(decoder, batch["input_ids"].to(device), bias, positions)
        targets = scored_targets(batch).to(device)
        losses = []
        for h, t in zip(hidden.split(HEAD_CHUNK), targets.split(HEAD_CHUNK), strict=True):
            with self.autocast(device):
                logits = head(h)
            losses.append(nn.functional.cross_entropy(logits.float(), t, reduction="none"))
        return torch.cat(losses), scored_weight(batch)

    @staticmethod
    def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each position's next-token cross-entropy and whether it counts, from every
        position's logits ``(B, L, V)``: position ``t`` predicts token ``t + 1``, which
        counts when it is labelled (a response token). Both ``(B, L - 1)``."""
        target = labels[:, 1:]
        counted = target != IGNORE
        losses = nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), target.clamp_min(0).flatten(), reduction="none"
        ).view(target.shape)
        return losses * counted, counted

    def loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy over the response tokens of the batch's real rows, from the
        logits at its :data:`SCORED` positions ``(K, V)`` or at every position ``(B, L, V)``."""
        if logits.dim() == 2:
            losses, weight = scored_losses(logits, batch)
            return (losses * weight).sum() / weight.sum().clamp_min(1.0)
        losses, counted = self.token_losses(logits, batch["labels"])
        weight = batch["weight"].unsqueeze(1) if "weight" in batch else 1.0
        return (losses * weight).sum() / (counted * weight).sum().clamp_min(1.0)


@torch.no_grad()
def response_nll(
    model: CausalLM, data: Encoded, batch_size: int, batch_tokens: int | None = None
) -> tuple[float, int]:
    """The summed negative log-likelihood of ``data``'s response tokens under ``model``
    (as loaded) and their count: perplexity is ``exp(nll / count)``. Batches of at most
    ``batch_size`` rows and ``batch_tokens`` tokens (:func:`fedpeft.data.task.eval_batches`)."""
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for rows in eval_batches(data.lengths, batch_size, batch_tokens):
        batch = with_scored({k: v.to(device) for k, v in make_batch(data, rows).items()})
        losses, weight = model.scored_nll(batch)
        total += float((losses * weight).sum())
        count += int(weight.sum())
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
def generate(
    model: CausalLM,
    data: Encoded,
    tokenizer,
    options,
    batch_size: int,
    batch_tokens: int | None = None,
    part: Part = WHOLE,
) -> list[str]:
    """The model's (as loaded) response to each prompt of ``data``, decoded; batches of at
    most ``batch_size`` prompts and ``batch_tokens`` tokens (prompts and new tokens).

    ``options`` (``fedpeft.config.GenerationConfig``): ``strategy`` greedy, beam
    (``num_beams``) or sample (``temperature``, ``top_p``, seeded by ``seed``), at most
    ``max_new_tokens`` new tokens; Hugging Face's ``generate`` with its KV cache.
    ``part``: only the responses of that part of the batches (the batches the whole set
    makes, so every prompt is generated in the batch it has in one pass); not for
    sampling, whose one random stream runs through the batches in order."""
    if part != WHOLE and options.strategy == "sample":
        raise ValueError(
            "sampled generation runs whole: its one random stream runs through the batches in order"
        )
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
        beams = options.num_beams if options.strategy == "beam" else 1
        lengths = (data.prompt_lengths + options.max_new_tokens) * beams  # the tokens a row holds
        batches = list(eval_batches(lengths, batch_size, batch_tokens))
        for rows in batches[share_of(len(batches), part)]:
            ids, mask = prompts_of(data, rows, pad_id)
            ids, mask = ids.to(device), mask.to(device)
            with torch.autocast(device.type, dtype=model.precision, enabled=model.precision is not None):
                out = model.backbone.generate(input_ids=ids, attention_mask=mask, **kwargs)
            texts += [
                t.strip() for t in tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
            ]
    return texts
