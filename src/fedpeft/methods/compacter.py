"""Compacter under FedAvg: Houlsby adapters with low-rank PHM projections (+ head).

Paper: "Compacter: Efficient Low-Rank Hypercomplex Adapter Layers" (Karimi Mahabadi,
Henderson and Ruder, NeurIPS 2021), a baseline of C2A (Kim et al., 2023, Tables 1, 2,
5); docs/c2a.md. The module is :mod:`fedpeft.peft.compacter`.

Readings and choices:

- Adapters at the Houlsby sites (after attention and after the feed-forward block of
  every layer), ``h + up(GELU(down(h)))``; each projection's weight is
  ``sum_{i=1..n} A_i (x) s_i t_i^T``, ``n = 4``, rank 1.
- The slow weights ``A_i`` are one tensor ``(n, n, n)`` shared by every PHM layer of
  the model, down and up projections alike (the paper: shared "across all layers";
  the reference code: one ``phm_rule`` set on every PHM layer). It is one parameter,
  trained and sent once.
- Bottleneck 16: C2A's adapter dimension; it also reproduces C2A's parameter share for
  Compacter (0.043 % of DistilBERT: 12 adapters x (2 (768 + 16) + 16 + 768) + 4^3).
  The Compacter paper uses a reduction factor of 32 on T5 (r = 24 for d = 768).
- What is sent: every trainable tensor (the shared ``A``, each layer's factors and
  biases, the head); FedAvg weights ``|D_i|``.
"""

from __future__ import annotations

from fedpeft.config.methods.compacter import CompacterConfig
from fedpeft.methods.base import Method
from fedpeft.methods.registry import register_method
from fedpeft.peft.compacter import add_compacter


@register_method(CompacterConfig)
class Compacter(Method):
    paper = "C2A baselines (Karimi Mahabadi et al., 2021)"

    def prepare(self, model) -> None:
        add_compacter(model.backbone, self.cfg.adapter, getattr(model.backbone.config, "model_type", ""))
        head = getattr(model, "head", None)  # a causal LM has none: its LM head stays frozen
        for p in head.parameters() if head is not None else []:
            p.requires_grad_(True)
        self.split_trainable(model)
