"""Every method's options, without the method: the config registry (``method.name`` ->
config class) that ``ExperimentConfig``'s ``method`` union is built from.

One leaf module per method (``fedpeft.config.methods.<name>``) holds its config class,
beside ``base`` (:class:`MethodConfig`, what every method's options share), ``specs``
(the options of the trainable modules: LoRA, adapters, prompts, ...) and ``ranks``
(heterogeneous LoRA ranks). Only pydantic here, no torch: a config is read and checked,
and ``fedpeft --help`` answers, without loading a model library. The methods themselves
(:mod:`fedpeft.methods`) import their config class from here; ``fedpeft.methods.REGISTRY``
names the same methods with the same config classes (tests/test_config.py checks it).
"""

from __future__ import annotations

from typing import Union

from fedpeft.config.methods.adamix import AdaMixConfig
from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.c2a import C2AConfig
from fedpeft.config.methods.centralized import CentralizedConfig
from fedpeft.config.methods.compacter import CompacterConfig
from fedpeft.config.methods.ditto import DittoConfig
from fedpeft.config.methods.fdlora import FDLoRAConfig
from fedpeft.config.methods.fedamp import FedAMPConfig
from fedpeft.config.methods.fedap import FedAPConfig
from fedpeft.config.methods.fedbf import FedBFConfig
from fedpeft.config.methods.federa import FeDeRAConfig
from fedpeft.config.methods.fedexlora import FedExLoRAConfig
from fedpeft.config.methods.fedft import FedFTConfig
from fedpeft.config.methods.fedkd import FedKDConfig
from fedpeft.config.methods.fedlr import FedLRConfig
from fedpeft.config.methods.fedmcp import FedMCPConfig
from fedpeft.config.methods.fedrep import FedRepConfig
from fedpeft.config.methods.fedrod import FedRoDConfig
from fedpeft.config.methods.fedsalora import FedSALoRAConfig
from fedpeft.config.methods.fedsb import FedSBConfig
from fedpeft.config.methods.ffalora import FFALoRAConfig
from fedpeft.config.methods.flexlora import FlexLoRAConfig
from fedpeft.config.methods.flora import FLoRAConfig
from fedpeft.config.methods.hetlora import HETLoRAConfig
from fedpeft.config.methods.local import LocalConfig
from fedpeft.config.methods.lorafair import LoRAFAIRConfig
from fedpeft.config.methods.moon import MOONConfig
from fedpeft.config.methods.perfedavg import PerFedAvgConfig
from fedpeft.config.methods.pf2lora import PF2LoRAConfig
from fedpeft.config.methods.prompt_tuning import PromptTuningConfig
from fedpeft.config.methods.rolora import RoLoRAConfig

#: ``method.name`` -> the method's config class, in ``fedpeft.methods.REGISTRY``'s order
CONFIGS: dict[str, type[MethodConfig]] = {
    cls.model_fields["name"].default: cls
    for cls in (
        FedFTConfig,
        FedBFConfig,
        FedAPConfig,
        FedLRConfig,
        PromptTuningConfig,
        CompacterConfig,
        AdaMixConfig,
        FeDeRAConfig,
        PF2LoRAConfig,
        PerFedAvgConfig,
        HETLoRAConfig,
        FedMCPConfig,
        FDLoRAConfig,
        C2AConfig,
        DittoConfig,
        MOONConfig,
        FedRepConfig,
        FedRoDConfig,
        FedAMPConfig,
        FedKDConfig,
        LocalConfig,
        CentralizedConfig,
        FFALoRAConfig,
        FedSALoRAConfig,
        RoLoRAConfig,
        FedExLoRAConfig,
        FlexLoRAConfig,
        LoRAFAIRConfig,
        FLoRAConfig,
        FedSBConfig,
    )
}


def method_config_union():
    """``Union`` of every method's config, for the discriminated ``method`` key."""
    return Union[tuple(CONFIGS.values())]  # noqa: UP007


__all__ = ["CONFIGS", "MethodConfig", "method_config_union"]
