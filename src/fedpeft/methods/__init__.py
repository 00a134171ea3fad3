"""The methods, one module each (its options, the config class, in
``fedpeft.config.methods``, importable without torch), and :data:`REGISTRY`: every module of
this package is imported here, and each method registers itself
(:func:`~fedpeft.methods.registry.register_method`)."""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING

from fedpeft.config.methods import method_config_union
from fedpeft.methods.base import Method, MethodConfig
from fedpeft.methods.registry import REGISTRY, order_registry, register_method

if TYPE_CHECKING:
    from fedpeft.config import TrainConfig
    from fedpeft.tensors import Combine

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
order_registry()


def build_method(cfg: MethodConfig, train: TrainConfig, seed: int = 0, mean: Combine | None = None) -> Method:
    """The configured method; ``seed`` is the experiment's (for a method's own draws),
    ``mean`` the rule its server combines uplinks by where it takes their mean
    (``server.aggregation``: :func:`fedpeft.engines.robust.combiner`; default the weighted
    mean)."""
    method = REGISTRY[cfg.name](cfg, train, seed)
    if mean is not None:
        method.mean = mean
    return method


__all__ = ["REGISTRY", "Method", "MethodConfig", "build_method", "method_config_union", "register_method"]
