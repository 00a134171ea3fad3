"""Every method's options, without the method.

One leaf module per method (``fedpeft.config.methods.<name>``) holds its config class and
registers it (:mod:`~fedpeft.config.methods.registry`), beside ``base``
(:class:`MethodConfig`, what every method's options share), ``specs`` (the options of the
trainable modules: LoRA, adapters, prompts, ...) and ``lora_ranks`` (heterogeneous LoRA ranks).
Only pydantic here, no torch: a config is read and checked, and ``fedpeft --help``
answers, without loading a model library. The methods themselves (:mod:`fedpeft.methods`)
import their config class from here; ``fedpeft.methods.REGISTRY`` names the same methods
with the same config classes (tests/config/test_config.py checks it).

``CONFIGS`` (``method.name`` -> config class, in ``fedpeft.methods.REGISTRY``'s order) and
each class by its name (``FedLRConfig``, ...) are read from the registry on first use, which
imports the methods' modules then.
"""

from __future__ import annotations

from typing import Any

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.registry import method_config_union, method_configs, register_method_config


def __getattr__(name: str) -> Any:
    if name == "CONFIGS":
        return method_configs()
    if name.endswith("Config"):
        for cls in method_configs().values():
            if cls.__name__ == name:
                return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CONFIGS", "MethodConfig", "method_config_union", "register_method_config"]
