"""C2A: Client-Customized Adaptation, adapters generated per client by a hypernetwork.

Paper: "Client-Customized Adaptation for Parameter-Efficient Federated Learning"
(Kim et al., Findings of ACL 2023); docs/c2a.md; the generator is
:mod:`fedpeft.peft.hyper`.

Each mini-batch's Houlsby adapters are generated from a client embedding built from
the batch's label distribution (uniform at inference), the context of the hidden
states entering each layer and a layer-index embedding; one factorised, Frobenius-
normalised hypernetwork with a tied down-projection serves every layer. What is
trained and aggregated (FedAvg, weights ``|D_i|``; sec. 3.5): the hypernetwork
(``F_U``, ``S_U``), the label and context projections, the layer embeddings and the
classifier head. Nothing else is trainable and nothing is personal (``head: personal``
keeps the head on the client, as for the other FedAvg-family methods).

Ablations (the paper's Table 3): ``hyper.label_embedding``, ``hyper.context_embedding``,
``hyper.factorise``, ``hyper.normalise``. The authors' code where it departs from the
paper's equations: ``hyper.normalise_scope``, ``generator_bias``, ``tie``, ``adapter_bias``,
``context_pool`` (defaults: the paper). Paper settings: ``t = 8``, ``s = 64``,
adapter rank ``r = 16`` (``adapter.bottleneck``).
"""

from __future__ import annotations

from torch.func import functional_call

from fedpeft.config.methods.c2a import C2AConfig
from fedpeft.engines.local import GradientFn, backprop, model_scale
from fedpeft.methods.base import Method, Tensors
from fedpeft.methods.registry import register_method
from fedpeft.peft.hyper import add_hyper_adapters


@register_method(C2AConfig)
class C2A(Method):
    paper = "C2A"
    refuses = {
        "causal_lm": "its label embedding is a batch's class distribution, which a language model has not",
        "token_classification": "its label embedding is a distribution over one class per example; a "
        "tagger labels tokens",
        "extractive_qa": "its label embedding is a distribution over one class per example; QA "
        "predicts spans",
    }

    def prepare(self, model) -> None:
        if self.cfg.adapter.activation != "gelu":
            raise ValueError("method.adapter.activation: C2A's generated adapters use GELU (the paper's)")
        add_hyper_adapters(model, self.cfg.hyper, self.cfg.adapter, model.head.out_features)
        for p in [*model.hyper.parameters(), *model.head.parameters()]:
            p.requires_grad_(True)
        self.split_trainable(model)

    def step_gradients(self, model) -> GradientFn:
        """Cross-entropy, with the batch's label distribution feeding the label embedding."""

        def loss(params: Tensors, consts: Tensors, batches):
            batch = batches[0]
            with model.hyper.labelled(batch["labels"], batch.get("weight")):
                logits = functional_call(model, params, (batch["input_ids"], batch["attention_mask"]))
            return model.loss(logits, batch)

        return backprop(loss, model_scale(model))
