""":data:`Tensors`, named tensors: what crosses between a method, an engine and a network
(uplinks, downlinks, personal state, checkpoints, a client store's entries), defined here
once for every layer, as a plain ``dict[str, torch.Tensor]``; and :data:`Combine`, a rule
that combines clients' tensors into one (``server.aggregation``: ``engines/robust.py``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

#: named tensors: a model's parameters (or their updates, an optimizer's state) by name
Tensors = dict[str, torch.Tensor]

#: ``(states, weights) -> state``: how a server combines its clients' tensors where it
#: takes their mean (``Method.mean``; the rules: ``fedpeft.engines.robust.combiner``)
Combine = Callable[[list[Tensors], list[float]], Tensors]
