""":data:`Tensors`, named tensors: what crosses between a method, an engine and a network
(uplinks, downlinks, personal state, checkpoints, a client store's entries), defined here
once for every layer, as a plain ``dict[str, torch.Tensor]``."""

from __future__ import annotations

import torch

#: named tensors: a model's parameters (or their updates, an optimizer's state) by name
Tensors = dict[str, torch.Tensor]
