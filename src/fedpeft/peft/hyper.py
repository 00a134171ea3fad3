"""C2A's client-conditional hypernetwork: Houlsby adapters generated per mini-batch.

Paper: "Client-Customized Adaptation for Parameter-Efficient Federated Learning"
(Kim et al., 2023), sec. 3; docs/c2a.md.

For a mini-batch ``B`` and layer ``l`` the client embedding is ``I_l = L + F_l + E_l``:

- ``L = W_L mean(onehot(y)) + b_L``, the batch's label distribution projected to ``t``
  (at inference, when the labels are unknown, the uniform distribution);
- ``F_l = W_F max_j(normalise(meanpool(h_l(x_j)))) + b_F``: each example's hidden
  states *entering* layer ``l``, mean-pooled over its tokens and L2-normalised, then
  max-pooled across the batch;
- ``E_l``, a learned embedding of the layer index.

One hypernetwork serves every layer: ``U_l = reshape(norm_F(F_U S_U)) I_l`` with
``F_U (d x s)``, ``S_U (s x r t)``, ``norm_F`` dividing by the Frobenius norm, and the
tied down-projection ``D_l = U_l^T``; the adapter is ``A_l(h) = U_l GELU(D_l h) + h``
on the output ``h`` of each Houlsby site of layer ``l`` (both sites of a layer use the
layer's one generated adapter: the paper generates one adapter per layer).

Readings where the paper leaves a choice (each stated so that it can be checked):

- Only a batch's *real* rows count: a cohort's padded rows (no attention token) add no
  label and are left out of the max-pool, so a client's adapters are the ones it gets alone.
- Without factorisation (ablation) the hypernetwork is one ``(d r) x t`` matrix ``W_U``,
  still normalised and tied; without normalisation ``norm_F`` is the identity.
- The adapters have no bias terms (the paper's equations have none).
- A batch's adapters depend on the whole batch, at inference too: predictions can
  change with ``eval.batch_size``, as in the paper's code.

How it runs inside a pure, vmapped step: the generator registers forward pre-hooks
(bound methods, so that a deep copy of the model stays consistent) on the task model,
to read the batch's attention mask, and on every adapted layer, to generate that
layer's adapter from the hidden states entering it; the sites read it back. A step
that knows its labels sets them for one forward pass with :meth:`Hypernetwork.labelled`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from fedpeft.config.methods.specs import HyperSpec
from fedpeft.peft.adapters import AdapterSpec, add_adapters


class Hypernetwork(nn.Module):
    """Generates every layer's adapter up-projection ``U_l (d x r)`` from ``I_l``."""

    def __init__(self, dim: int, rank: int, num_layers: int, num_classes: int, spec: HyperSpec):
        super().__init__()
        t, s = spec.embedding_dim, spec.factor_dim
        self.dim, self.rank, self.spec = dim, rank, spec
        self.num_classes = num_classes
        if spec.factorise:
            self.F_U = nn.Parameter(torch.randn(dim, s) * 1e-2)
            self.S_U = nn.Parameter(torch.randn(s, rank * t) * 1e-2)
        else:
            self.W_U = nn.Parameter(torch.randn(dim, rank * t) * 1e-2)
        self.B_U = nn.Parameter(torch.zeros(dim, rank)) if spec.generator_bias else None
        self.adapter_biases = (
            nn.ParameterList([nn.Parameter(torch.zeros(rank)), nn.Parameter(torch.zeros(dim))])
            if spec.adapter_bias
            else None
        )
        self.label = nn.Linear(num_classes, t) if spec.label_embedding else None
        self.context = nn.Linear(dim, t) if spec.context_embedding else None
        self.layers = nn.Embedding(num_layers, t)
        # the state of the forward pass under way (never parameters, never saved)
        self._labels: torch.Tensor | None = None  # (C,) the batch's label distribution
        self._mask: torch.Tensor | None = None  # (B, T) the batch's attention mask
        self._adapters: dict[int, torch.Tensor] = {}  # layer -> U_l of this batch

    # ----- the generator
    def weight(self) -> torch.Tensor:
        """``W_U`` as a ``(d, r, t)`` tensor: ``norm_F(F_U S_U)`` reshaped (with the
        authors'-code options: ``+ B_U`` on every slice, each slice normalised)."""
        w = self.F_U @ self.S_U if self.spec.factorise else self.W_U
        w = w.reshape(self.dim, self.rank, self.spec.embedding_dim)
        if self.B_U is not None:
            w = w + self.B_U.unsqueeze(-1)
        if self.spec.normalise:
            slices = self.spec.normalise_scope == "slice"
            w = w / torch.linalg.vector_norm(w, dim=(0, 1) if slices else None, keepdim=slices)
        return w

    def client_embedding(
        self, layer: int, hidden: torch.Tensor | None, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """``I_l`` (``t``) of the current batch at layer ``layer``, from the hidden states
        entering it ``(B, T, d)`` and the batch's attention mask ``(B, T)``."""
        emb = self.layers.weight[layer]
        if self.label is not None:
            labels = self._labels
            if labels is None:  # inference: the labels are unknown
                labels = torch.full((self.num_classes,), 1.0 / self.num_classes, device=emb.device)
            emb = emb + self.label(labels.to(self.label.weight.dtype))
        if self.context is not None:
            context = batch_context(hidden, mask, self.spec.context_pool)
            emb = emb + self.context(context.to(self.context.weight.dtype))
        return emb

    def generate(self, embedding: torch.Tensor) -> torch.Tensor:
        """``U = W_U I`` ``(d, r)``."""
        weight = self.weight()
        return weight @ embedding.to(weight.dtype)

    # ----- the forward pass's state
    @contextmanager
    def labelled(self, labels: torch.Tensor, weight: torch.Tensor | None = None) -> Iterator[None]:
        """The label embedding of the batch with class labels ``labels`` ``(B,)`` (rows of
        ``weight`` 0 do not count) for the forward passes inside the block."""
        classes = torch.arange(self.num_classes, device=labels.device)
        onehot = (labels.unsqueeze(-1) == classes).float()  # one_hot has no vmap rule
        w = torch.ones(labels.shape, device=labels.device) if weight is None else weight.float()
        self._labels = (onehot * w.unsqueeze(-1)).sum(0) / w.sum().clamp_min(1.0)
        try:
            yield
        finally:
            self._labels = None

    def enter_model(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of the task model: remember the batch's attention mask."""
        self._mask = args[1] if len(args) > 1 else kwargs.get("attention_mask")
        self._adapters = {}

    def leave_model(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        """Forward hook of the task model: forget the pass's tensors."""
        self._mask, self._adapters = None, {}

    def enter_layer(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of layer ``module.c2a_layer``: generate its adapter."""
        hidden = args[0] if args else kwargs["hidden_states"]
        mask = self._mask
        if mask is not None and mask.shape != hidden.shape[:2]:
            raise ValueError(f"C2A: attention mask {tuple(mask.shape)} does not match hidden states "
                             f"{tuple(hidden.shape)}")  # fmt: skip
        embedding = self.client_embedding(module.c2a_layer, hidden, mask)
        self._adapters[module.c2a_layer] = self.generate(embedding)

    def adapter(self, layer: int) -> torch.Tensor:
        """This batch's ``U_l``; an error outside a forward pass of the task model."""
        if layer not in self._adapters:
            raise RuntimeError(
                f"C2A: no adapter generated for layer {layer} (the layer's pre-hook did not run)"
            )
        return self._adapters[layer]


def batch_context(hidden: torch.Tensor, mask: torch.Tensor | None, pool: str = "max") -> torch.Tensor:
    """``max_j normalise(meanpool(h(x_j)))`` ``(d,)`` over the batch's real rows (those
    with an attention token): the input of the context embedding (``pool="mean"``: the
    mean over those rows instead of the max)."""
    hidden = hidden.float()
    if mask is None:
        mask = torch.ones(hidden.shape[:2], device=hidden.device)
    m = mask.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
    pooled = (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)  # (B, d)
    pooled = nn.functional.normalize(pooled, dim=-1)
    real = mask.sum(1) > 0  # (B,)
    if pool == "mean":
        weight = real.to(pooled.dtype).unsqueeze(-1)
        return (pooled * weight).sum(0) / weight.sum().clamp_min(1.0)
    pooled = torch.where(real.unsqueeze(-1), pooled, torch.finfo(pooled.dtype).min)
    return torch.where(real.any(), pooled.max(0).values, 0.0)


class GeneratedAdapter(nn.Module):
    """``h + U GELU(U^T h)`` with this batch's ``U`` of layer ``layer`` from ``hyper``
    (``hyper.spec.tie == "view"``: ``U^T`` replaced by ``U``'s entries read as ``r x d``;
    ``adapter_bias``: ``h + GELU(h U + b_r) D + b_d``)."""

    def __init__(self, hyper: Hypernetwork, layer: int):
        super().__init__()
        object.__setattr__(self, "hyper", hyper)  # a reference, not a submodule: counted once
        self.layer = layer

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        u = self.hyper.adapter(self.layer).to(h.dtype)  # (d, r)
        down = u.T if self.hyper.spec.tie == "transpose" else u.reshape(u.shape[1], u.shape[0])
        biases = self.hyper.adapter_biases
        if biases is None:
            return h + nn.functional.gelu(h @ u) @ down
        return h + nn.functional.gelu(h @ u + biases[0].to(h.dtype)) @ down + biases[1].to(h.dtype)


LAYER_INDEX = re.compile(r"^(.*?\.(\d+))\.")  # "encoder.layer.3.attention.output.dense" -> encoder.layer.3, 3


def add_hyper_adapters(
    model: nn.Module, spec: HyperSpec, adapter: AdapterSpec, num_classes: int
) -> Hypernetwork:
    """Insert generated adapters at ``adapter``'s sites of ``model.backbone`` (Houlsby's
    by default), attach the hypernetwork as ``model.hyper`` and hook it into the forward
    pass; returns it."""
    backbone = model.backbone
    config = backbone.config
    sites = add_adapters(backbone, adapter, config.model_type, kind=lambda *_: nn.Identity())
    layers: dict[int, str] = {}
    for name in sites:
        found = LAYER_INDEX.match(name)
        if not found:
            raise ValueError(f"method.adapter.sites: {name!r} is in no numbered layer; C2A generates one "
                             "adapter per layer")  # fmt: skip
        layers[int(found.group(2))] = found.group(1)
    num_layers = config.num_hidden_layers
    if max(layers) >= num_layers:
        raise ValueError(f"C2A: layer {max(layers)} of the adapted sites, but the backbone has {num_layers}")
    hyper = Hypernetwork(config.hidden_size, adapter.bottleneck, num_layers, num_classes, spec)
    hyper.to(dtype=next(backbone.parameters()).dtype)
    model.hyper = hyper
    for name in sites:
        site = backbone.get_submodule(name)
        site.adapter = GeneratedAdapter(hyper, int(LAYER_INDEX.match(name).group(2)))
    for index, name in layers.items():
        layer = backbone.get_submodule(name)
        layer.c2a_layer = index
        layer.register_forward_pre_hook(hyper.enter_layer, with_kwargs=True)
    model.register_forward_pre_hook(hyper.enter_model, with_kwargs=True)
    model.register_forward_hook(hyper.leave_model, with_kwargs=True)
    return hyper
