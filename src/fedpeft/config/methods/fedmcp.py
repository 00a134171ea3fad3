"""FedMCP: a global and a private adapter per client, tied by a model-contrastive term.

The options of ``method.name: fedmcp``; the method itself is :mod:`fedpeft.methods.fedmcp`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.registry import register_method_config
from fedpeft.config.methods.specs import AdapterSpec


@register_method_config("fedmcp", order=120)
class FedMCPConfig(MethodConfig):
    """Global + private Houlsby adapters, two heads, CKA contrast. Paper: FedMCP, sec. 3."""

    name: Literal["fedmcp"] = "fedmcp"
    head: Literal["personal"] = Field(
        "personal", description="Both classifiers stay on the client (the paper shares none across tasks)."
    )
    adapter: AdapterSpec = Field(
        default_factory=lambda: AdapterSpec(bottleneck=16),
        description="Both adapters (paper: bottleneck 16).",
    )
    gamma: float = Field(0.5, ge=0, le=1, description="Weight of L_b, the global path's loss.")
    mu: float = Field(0.05, ge=0, description="Weight of L_c, the contrastive term.")
    contrast: Literal["prose", "equation"] = Field(
        "prose",
        description="prose: L_c = CKA(X, Y) - CKA(X, Z), as the paper's text describes (pull the global "
        "path to the received average, push it from the private one); equation: CKA(X, Y) - CKA(Y, Z), "
        "the paper's eq. 5 as printed.",
    )
