"""The method registry: one line per method (its module holds the algorithm; its options,
the config class, are in ``fedpeft.config.methods.<name>``, importable without torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedpeft.config.methods import method_config_union
from fedpeft.config.methods.registry import BUILTIN
from fedpeft.methods.adamix import AdaMix
from fedpeft.methods.base import Method, MethodConfig
from fedpeft.methods.c2a import C2A
from fedpeft.methods.centralized import Centralized
from fedpeft.methods.compacter import Compacter
from fedpeft.methods.ditto import Ditto
from fedpeft.methods.fdlora import FDLoRA
from fedpeft.methods.fedamp import FedAMP
from fedpeft.methods.fedap import FedAP
from fedpeft.methods.fedbf import FedBF
from fedpeft.methods.federa import FeDeRA
from fedpeft.methods.fedexlora import FedExLoRA
from fedpeft.methods.fedft import FedFT
from fedpeft.methods.fedkd import FedKD
from fedpeft.methods.fedlr import FedLR
from fedpeft.methods.fedmcp import FedMCP
from fedpeft.methods.fedrep import FedRep
from fedpeft.methods.fedrod import FedRoD
from fedpeft.methods.fedsalora import FedSALoRA
from fedpeft.methods.fedsb import FedSB
from fedpeft.methods.ffalora import FFALoRA
from fedpeft.methods.flexlora import FlexLoRA
from fedpeft.methods.flora import FLoRA
from fedpeft.methods.hetlora import HETLoRA
from fedpeft.methods.local import LocalOnly
from fedpeft.methods.lorafair import LoRAFAIR
from fedpeft.methods.moon import MOON
from fedpeft.methods.perfedavg import PerFedAvg
from fedpeft.methods.pf2lora import PF2LoRA
from fedpeft.methods.prompt_tuning import PromptTuning
from fedpeft.methods.rolora import RoLoRA

if TYPE_CHECKING:
    from fedpeft.config import TrainConfig
    from fedpeft.engines.robust import Combine

#: method.name -> its class, in the order the built-in configs are listed
#: (``fedpeft.config.methods.registry.BUILTIN``: ``fedpeft methods`` and the tables follow it)
REGISTRY: dict[str, type[Method]] = {
    cls.name: cls
    for cls in sorted(
        (
            AdaMix,
            C2A,
            Centralized,
            Compacter,
            Ditto,
            FDLoRA,
            FFALoRA,
            FLoRA,
            FeDeRA,
            FedAMP,
            FedAP,
            FedBF,
            FedExLoRA,
            FedFT,
            FedKD,
            FedLR,
            FedMCP,
            FedRep,
            FedRoD,
            FedSALoRA,
            FedSB,
            FlexLoRA,
            HETLoRA,
            LoRAFAIR,
            LocalOnly,
            MOON,
            PF2LoRA,
            PerFedAvg,
            PromptTuning,
            RoLoRA,
        ),
        key=lambda cls: BUILTIN.index(cls.name),
    )
}


def build_method(cfg: MethodConfig, train: TrainConfig, seed: int = 0, mean: Combine | None = None) -> Method:
    """The configured method; ``seed`` is the experiment's (for a method's own draws),
    ``mean`` the rule its server combines uplinks by where it takes their mean
    (``server.aggregation``: :func:`fedpeft.engines.robust.combiner`; default the weighted
    mean)."""
    method = REGISTRY[cfg.name](cfg, train, seed)
    if mean is not None:
        method.mean = mean
    return method


__all__ = ["REGISTRY", "Method", "MethodConfig", "build_method", "method_config_union"]
