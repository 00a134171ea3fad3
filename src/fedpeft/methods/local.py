"""Local-only: every client trains alone; nothing is sent either way (lower reference).

All trainable tensors are personal. There is no global model: scores on the global
test set are the mean over clients of each client's own model.
"""

from typing import Literal

from pydantic import Field

from fedpeft.methods.base import FitResult, MethodConfig, ServerState, Tensors
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.peft import AdapterSpec, LoraSpec, Trainable


class LocalConfig(MethodConfig):
    """Each client fine-tunes its own copy of the trainable tensors."""

    name: Literal["local"] = "local"
    trainable: Trainable = Field("lora", description="What each client trains.")
    lora: LoraSpec = Field(default_factory=LoraSpec)
    adapter: AdapterSpec = Field(default_factory=AdapterSpec)


class LocalOnly(FedAvgPeft):
    dora = True
    name = "local"
    config_cls = LocalConfig

    def split_trainable(self, model) -> None:
        self.personal_names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.shared_names = []

    def downlink(self, server: ServerState, cid: int) -> Tensors:
        return {}

    def aggregate(self, server: ServerState, results: list[FitResult], rnd: int) -> ServerState:
        return server
