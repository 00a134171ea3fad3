"""FedBF: FedAvg over the bias terms and the head (BitFit, Ben Zaken et al., 2022).

The options of ``method.name: fedbf``; the method itself is :mod:`fedpeft.methods.fedbf`.
"""

from __future__ import annotations

from typing import Literal

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.registry import register_method_config


@register_method_config("fedbf", order=20)
class FedBFConfig(MethodConfig):
    """BitFit under FedAvg. Paper: FeDeRA (Yan et al., 2024), sec. 5.1 baselines."""

    name: Literal["fedbf"] = "fedbf"
