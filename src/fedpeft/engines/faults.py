"""Simulated faulty clients (issue 32): what robust aggregation is tested against.

``faults.byzantine_clients: k`` picks k clients from the experiment's seed (the same
ones every run of that seed); each time one is sampled, the engine corrupts what it
returns, after its local round and before the server sees it (methods never know):

- ``sign_flip``: the update reversed, ``received - (uplink - received)``;
- ``scale``: the update times ``faults.scale``;
- ``gaussian``: the update replaced by noise of std ``faults.noise_std`` (seeded by the
  seed, round and client);
- ``label_flip``: the client trains on flipped labels (class ``y`` becomes ``C - 1 - y``),
  applied once to its training data; its update is then sent as it is.

The model attacks need an uplink in the names and shapes of what the client received
(the update is their difference); a method whose uplink is something else (FedKD's
compressed update) is refused, named. The round's record lists the faulty clients it
sampled (``byzantine``). The in-process engine only: a deployed node runs its own code.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from fedpeft.config import ConfigError, FaultsConfig
from fedpeft.data.task import Encoded
from fedpeft.engines.local import derive_seed
from fedpeft.methods.base import FitResult, Tensors

FAULT_STREAM = 0xFA017  # the seed stream that picks the faulty clients and draws their noise


def faulty_clients(cfg: FaultsConfig, seed: int, num_clients: int) -> list[int]:
    """The ``faults.byzantine_clients`` clients, drawn from the experiment's seed: the first
    k of one seeded order of the clients, so that with more faulty clients the same seed
    adds clients to the fewer's (a robustness table compares nested sets)."""
    if cfg.byzantine_clients > num_clients:
        raise ConfigError(
            f"faults.byzantine_clients: {cfg.byzantine_clients} faulty clients but partition.num_clients "
            f"is {num_clients}"
        )
    rng = np.random.default_rng(derive_seed(seed, FAULT_STREAM))
    return sorted(rng.permutation(num_clients)[: cfg.byzantine_clients].tolist())


def flip_labels(data: Encoded, num_classes: int) -> Encoded:
    """``data`` with every class label ``y`` as ``num_classes - 1 - y``."""
    if data.labels.dim() != 1:
        raise ConfigError("faults.attack label_flip: class labels only (data.task classification)")
    return dataclasses.replace(data, labels=num_classes - 1 - data.labels)


def corrupt(
    cfg: FaultsConfig, result: FitResult, received: Tensors, seed: int, rnd: int, method: str
) -> FitResult:
    """``result`` with its uplink corrupted by ``cfg.attack`` (a model attack)."""
    gen = torch.Generator().manual_seed(derive_seed(seed, FAULT_STREAM, rnd, result.cid))
    uplink = {}
    for name, sent in result.uplink.items():
        start = received.get(name)
        if start is None or start.shape != sent.shape or not sent.is_floating_point():
            raise ConfigError(
                f"faults.attack {cfg.attack}: method {method} sends {name!r}, not a tensor it received; "
                "a model attack corrupts an update (uplink - received)"
            )
        update = sent.double() - start.double()
        if cfg.attack == "sign_flip":
            update = -update
        elif cfg.attack == "scale":
            update = cfg.scale * update
        else:  # gaussian
            update = cfg.noise_std * torch.randn(update.shape, generator=gen, dtype=torch.float64)
        uplink[name] = (start.double() + update).to(sent.dtype)
    return dataclasses.replace(result, uplink=uplink)
