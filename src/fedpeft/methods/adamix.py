"""AdaMix under FedAvg: a mixture of adapter experts per site, routed at random in
training, averaged for inference (+ head).

Paper: "AdaMix: Mixture-of-Adaptations for Parameter-efficient Model Tuning" (Wang et
al., EMNLP 2022), a baseline of C2A (Kim et al., 2023, Tables 1, 2, 5); docs/c2a.md. The
module is :mod:`fedpeft.peft.adamix`.

Our reading of AdaMix:

- Every adapter site holds ``M = 4`` down-projection and ``M`` up-projection experts
  (bottleneck ``r``, GELU between them, ``h + up(GELU(down(h)))``).
- Stochastic routing: at every training step each site uses one down and one up
  expert drawn uniformly at random, independently per site and per projection, the
  same for every token of the batch (no learned router, no load balancing).
- Consistency regularisation: each step runs two forward passes with independent
  routings, ``A`` and ``B``; the loss is the cross-entropy of pass ``A`` plus
  ``consistency`` times the symmetric KL divergence between the two passes' predictive
  distributions, ``(KL(p_B || p_A) + KL(p_A || p_B)) / 2``, each KL's first argument
  (the target) held constant, as AdaMix's code computes it; weight 1 for classification
  (its NLG code uses 100). Averaged over the rows (classification) or the positions the
  task's loss counts (tagged tokens, response tokens; QA: the start and the end
  distribution over positions).
- Merging: at inference the experts of each projection are averaged into one weight
  (and bias), a single adapter of Houlsby size.
- Initialisation: every expert starts as the same copy (AdaMix's code); the up
  projections at 0, so the model starts as the pretrained one.

Choices for fedpeft:

- Sites: the Houlsby sites, as FedAP, with bottleneck 16 (C2A's adapter dimension).
  C2A's parameter share for AdaMix (0.277 % of multilingual DistilBERT) is reproduced by
  AdaMix's released recipe instead: one site per layer after the feed-forward block
  (``adapter.sites``), four down experts and one shared up projection
  (``adapter.share_up: true``).
- Routing draws are data of the step: :meth:`AdaMix.step_draws` draws each step's
  indices ``(passes, sites, 2)`` from a generator seeded from the client's round seed
  (its own stream, so the batches are those FedAvg would draw) and passes them with the
  batch; the pure step turns them into one-hot mixes (:func:`routed_mixes`). No global
  random state is read inside the step, so a cohort vmaps and a run reproduces.
- What is communicated: every expert (the trained model is the mixture; averaging the
  experts before sending would collapse them into one adapter every round), plus the
  head; FedAvg weights ``|D_i|`` per expert. The bytes are all of them, ``M`` times a
  Houlsby adapter's for unshared projections.
- The reported training loss is pass ``A``'s cross-entropy (comparable with the other
  methods); the differentiated one adds the consistency term.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.func import functional_call

from fedpeft.config.methods.adamix import AdaMixConfig
from fedpeft.data.task import IGNORE, Draw, take_rows
from fedpeft.engines.local import (
    GradientFn,
    Job,
    StepInput,
    backprop_reporting,
    derive_seed,
    model_inputs,
    model_scale,
)
from fedpeft.methods.base import Method, Tensors
from fedpeft.methods.capabilities import OWN_BATCHES
from fedpeft.methods.registry import register_method
from fedpeft.peft.adamix import AdaMixAdapter, add_adamix, routed_mixes

ROUTE = "route"  # a step batch's routing: (passes, sites, 2) expert indices, down and up
ROUTE_STREAM = 0xADA  # key of the routing generator's stream, beside the client's batch stream


def consistency_loss(model, a: torch.Tensor, b: torch.Tensor, batch: dict) -> torch.Tensor:
    """``(KL(sg p_b || p_a) + KL(sg p_a || p_b)) / 2`` between the predictive distributions of
    two passes' outputs ``a``, ``b`` (``sg``: no gradient through the target), averaged
    over what ``model``'s loss counts: rows, tagged tokens, response tokens, or a span's
    start and end distributions over the valid positions (the docstring above); a causal
    LM's outputs are every position's or only the scored positions' (``SCORED``)."""
    from fedpeft.models.backbone import SpanExtractor, TokenClassifier
    from fedpeft.models.causal import CausalLM, scored_weight

    labels = batch["labels"]
    rows = batch["weight"] if "weight" in batch else torch.ones(labels.shape[0], device=a.device)
    if isinstance(model, SpanExtractor):  # (B, L, 2) -> (B, 2, L): distributions over positions
        hidden = torch.finfo(a.dtype).min / 2
        valid = (labels != IGNORE).unsqueeze(-1)
        a, b = (x.masked_fill(~valid, hidden).transpose(1, 2) for x in (a, b))
        weight = rows.unsqueeze(1).expand(-1, 2)
    elif isinstance(model, CausalLM) and a.dim() == 2:  # (K, V): at the scored positions
        weight = scored_weight(batch)
    elif isinstance(model, CausalLM):  # position t predicts token t + 1
        a, b = a[:, :-1], b[:, :-1]
        weight = (labels[:, 1:] != IGNORE) * rows.unsqueeze(1)
    elif isinstance(model, TokenClassifier):
        weight = (labels != IGNORE) * rows.unsqueeze(1)
    else:
        weight = rows
    log_a, log_b = a.float().log_softmax(-1), b.float().log_softmax(-1)
    to_b = (log_b.exp().detach() * (log_b.detach() - log_a)).sum(-1)  # KL(p_b || p_a), p_b held
    to_a = (log_a.exp().detach() * (log_a.detach() - log_b)).sum(-1)  # KL(p_a || p_b), p_a held
    return ((to_b + to_a) / 2 * weight).sum() / weight.sum().clamp_min(1.0)


@register_method(AdaMixConfig)
class AdaMix(Method):
    paper = "C2A baselines (Wang et al., 2022)"
    refuses = {"sample_dp": OWN_BATCHES}  # each batch with its routing

    def prepare(self, model) -> None:
        add_adamix(model.backbone, self.cfg.adapter, getattr(model.backbone.config, "model_type", ""))
        #: the adapter modules' names, in the order of a route's site axis
        self.sites = [n for n, m in model.named_modules() if isinstance(m, AdaMixAdapter)]
        head = getattr(model, "head", None)  # a causal LM has none: its LM head stays frozen
        for p in head.parameters() if head is not None else []:
            p.requires_grad_(True)
        self.split_trainable(model)

    @property
    def passes(self) -> int:
        return 2 if self.cfg.consistency > 0 else 1

    def step_draws(self, job: Job, steps: int, generator: torch.Generator) -> Iterator[tuple[Draw]]:
        """FedAvg's batches, each with its routing (``ROUTE``), drawn from the client's own
        routing stream (seeded from its round's seed)."""
        spec, client = self.cfg.adapter, job.client
        router = torch.Generator().manual_seed(derive_seed(generator.initial_seed(), ROUTE_STREAM))
        for rows in take_rows(len(client.train), job.context.train.batch_size, steps, generator):
            route = torch.randint(0, spec.experts, (self.passes, len(self.sites), 2), generator=router)
            if spec.share_down:
                route[..., 0] = 0
            if spec.share_up:
                route[..., 1] = 0
            yield (Draw(client.train, rows, {ROUTE: route}),)

    def objective(self, model):
        """``(params, consts, batches) -> (loss to differentiate, loss to report)``: the
        cross-entropy of the first routed pass plus ``consistency`` times
        :func:`consistency_loss` against the second; and that cross-entropy."""
        spec, weight, sites = self.cfg.adapter, self.cfg.consistency, self.sites
        down = 1 if spec.share_down else spec.experts
        up = 1 if spec.share_up else spec.experts

        def value(params: Tensors, consts: Tensors, batches: StepInput):
            batch = batches[0]

            def routed(p: int) -> torch.Tensor:
                mixes = routed_mixes(batch[ROUTE][p], sites, down, up, torch.float32)
                args, kwargs = model_inputs(batch)
                return functional_call(model, {**params, **mixes}, args, kwargs)

            first = routed(0)
            ce = model.loss(first, batch)
            if weight == 0:
                return ce, ce
            return ce + weight * consistency_loss(model, first, routed(1), batch), ce

        return value

    def step_gradients(self, model) -> GradientFn:
        return backprop_reporting(self.objective(model), model_scale(model))
