"""Time to target (FeDeRA paper, sec. 5.4 and app. B): what it costs to reach a score.

For a target value of the global accuracy, the first evaluated round reaching 90/95/99 %
of it, with the bytes sent by then and the wall-clock split into local training,
communication and decomposition. Clients are taken to work in parallel, each on its own
link, as in the paper's testbed: a round costs its slowest client's training
(``time_fit_max``) plus one client's transfer, ``bytes / bandwidth + 2 * latency``.
The simulation's own sequential training time is reported beside it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Link:
    """A client's network link: bandwidth (Mbit/s) and per-message latency (ms)."""

    bandwidth_mbit: float = 25.0  # the paper's Wi-Fi testbed
    latency_ms: float = 0.0

    def seconds(self, num_bytes: float, messages: int = 2) -> float:
        return num_bytes * 8 / (self.bandwidth_mbit * 1e6) + messages * self.latency_ms / 1e3


def round_costs(record: dict, link: Link) -> dict[str, float]:
    """One round's parallel-time costs: slowest client's training, one client's transfers."""
    clients = max(1, len(record["clients"]))
    per_client_bytes = (record["bytes_down"] + record["bytes_up"]) / clients
    comm = link.seconds(per_client_bytes) if per_client_bytes else 0.0
    return {"train": record.get("time_fit_max", record["time_train"]), "comm": comm}


def time_to_target(
    records: list[dict],
    target: float,
    link: Link,
    fractions: tuple[float, ...] = (0.9, 0.95, 0.99),
    metric: str = "accuracy",
) -> list[dict]:
    """Per fraction: round, bytes and seconds (train, comm, decompose, total) to reach
    that fraction of ``target`` in the global ``metric``."""
    decompose = records[0].get("setup", {}).get("time_decompose", 0.0) if records else 0.0
    rows = []
    for frac in fractions:
        train = comm = sim_train = 0.0
        reached = None
        for r in records:
            cost = round_costs(r, link)
            train, comm, sim_train = train + cost["train"], comm + cost["comm"], sim_train + r["time_train"]
            acc = (r.get("global") or {}).get(metric)
            if acc is not None and acc >= frac * target:
                reached = r
                break
        row = {"fraction": frac, "goal": frac * target, "round": None}
        if reached is not None:
            row.update(
                round=reached["round"],
                bytes=reached["cum_bytes"],
                train_s=train,
                comm_s=comm,
                decompose_s=decompose,
                total_s=train + comm + decompose,
                simulated_train_s=sim_train,
            )
        rows.append(row)
    return rows
