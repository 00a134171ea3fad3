"""Centralized: all clients' training data pooled into one model (upper reference).

The runner gives this method a single client holding the pooled data; a round takes
as many optimizer steps as the federated round it stands beside would take in all.
"""

from fedpeft.config.methods.centralized import CentralizedConfig
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.methods.registry import register_method


@register_method(CentralizedConfig)
class Centralized(FedAvgPeft):
    pooled = True  # the data, not the model, was moved: no per-round traffic
    refuses = {"dora": "", "secure_aggregation": "its clients' data is pooled in one place: nothing is sent"}
