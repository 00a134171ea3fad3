"""Prompt tuning under FedAvg: a soft prompt (+ head) trained and averaged.

Paper: "The Power of Scale for Parameter-Efficient Prompt Tuning" (Lester et al., EMNLP
2021), a baseline of C2A (Kim et al., 2023, Tables 1, 2, 5); docs/c2a.md.
The module is :mod:`fedpeft.peft.prompt`.

Readings and choices:

- ``P`` virtual tokens (HF PEFT's ``PromptEmbedding``) are prepended to the token
  embeddings of every input, before ``[CLS]``, as HF PEFT does; the backbone stays
  frozen. Lester et al. read the answer off a frozen T5's decoder; an encoder has no
  verbaliser, so, like every fedpeft method and like C2A's baselines on DistilBERT, a
  linear head is trained (and shared, unless ``head: personal``).
- ``P``: C2A does not state it; ``num_virtual_tokens: 20`` reproduces its parameter
  share (0.024 % of 66M = 20 x 768). Lester et al. use 100 and report little change
  above 20 for large models.
- Initialisation: ``sample_vocab`` (default), the embeddings of random vocabulary tokens
  (HF PEFT's, from the whole vocabulary rather than Lester et al.'s 5,000 commonest);
  ``uniform``, their U(-0.5, 0.5).
- What is sent: the prompt ``(P, H)`` and the head; FedAvg weights ``|D_i|``.
- Tasks: sequence classification, token classification and extractive QA (the virtual
  positions are cut from the backbone's output, so token labels and spans stay where
  they are). Not causal LM: generation runs the Hugging Face ``generate`` loop with its
  KV cache on the bare decoder, which would have to carry the prompt too.
"""

from __future__ import annotations

from fedpeft.config.methods.prompt_tuning import PromptTuningConfig
from fedpeft.methods.base import Method
from fedpeft.methods.registry import register_method
from fedpeft.peft.prompt import PromptedBackbone


@register_method(PromptTuningConfig)
class PromptTuning(Method):
    paper = "C2A baselines (Lester et al., 2021)"
    refuses = {
        "causal_lm": "generation (Hugging Face generate with its KV cache) runs on the bare decoder, "
        "which does not carry the soft prompt"
    }

    def prepare(self, model) -> None:
        model.backbone = PromptedBackbone(model.backbone, self.cfg.prompt, model.causal)
        for p in model.head.parameters():
            p.requires_grad_(True)
        self.split_trainable(model)
