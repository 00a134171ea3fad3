"""Local-only: every client trains alone; nothing is sent either way (lower reference).

All trainable tensors are personal. There is no global model: scores on the global
test set are the mean over clients of each client's own model.
"""

from fedpeft.config.methods.local import LocalConfig
from fedpeft.methods.base import FitResult, ServerState, Tensors
from fedpeft.methods.capabilities import SHARES_NOTHING
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.methods.registry import register_method


@register_method(LocalConfig)
class LocalOnly(FedAvgPeft):
    refuses = {  # nothing shared: no server step, hence no correction, robust rule or user-level DP
        "dora": "",
        "secure_aggregation": "nothing is aggregated: every client trains alone",
        "server_step": SHARES_NOTHING,
    }

    def split_trainable(self, model) -> None:
        self.personal_names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.shared_names = []

    def downlink(self, server: ServerState, cid: int) -> Tensors:
        return {}

    def aggregate(self, server: ServerState, results: list[FitResult], rnd: int) -> ServerState:
        return server
