"""Time and rounds to target: what it costs to reach a score.

Rounds to target (C2A paper, sec. 5.3 and Table 4): per run, the first round whose
global score reached the target, and the speed-up over a baseline run, baseline rounds
divided by the run's rounds; :func:`rounds_to_target`.

Time to target (FeDeRA paper, sec. 5.4 and app. B; :func:`time_to_target`): for a
target value of the global accuracy, the first evaluated round reaching 90/95/99 %
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


def first_round_reaching(records: list[dict], target: float, metric: str = "accuracy") -> int | None:
    """The first evaluated round whose global ``metric`` is at least ``target`` (None: none)."""
    for r in records:
        value = (r.get("global") or {}).get(metric)
        if value is not None and value >= target:
            return r["round"]
    return None


def rounds_to_target(
    runs: dict[str, list[dict]], target: float, baseline: str, metric: str = "accuracy"
) -> list[dict]:
    """The C2A paper's Table 4 for one target: per run (label -> its records), ``round``, the
    first round its global ``metric`` reached ``target`` (None: not reached in the
    ``rounds_run`` rounds it ran), and ``speedup`` relative to run ``baseline`` (a label of
    ``runs``): baseline's rounds / the run's rounds. When only one of the two reached the
    target the speed-up is a bound (``bound``: ``"<="`` when the run did not reach it, at most
    baseline / (rounds_run + 1); ``">="`` when the baseline did not, at least
    (baseline's rounds_run + 1) / run); neither: None. Rounds count evaluated rounds only
    (with ``eval.every`` > 1 a round is the first evaluation at or above the target)."""
    if baseline not in runs:
        raise KeyError(f"baseline {baseline!r} is not one of the runs {sorted(runs)}")
    reached = {label: first_round_reaching(records, target, metric) for label, records in runs.items()}
    ran = {label: (records[-1]["round"] if records else 0) for label, records in runs.items()}
    base, base_ran = reached[baseline], ran[baseline]
    rows = []
    for label in runs:
        mine = reached[label]
        speedup, bound = None, None
        if mine is not None and base is not None:
            speedup, bound = base / mine, "="
        elif mine is None and base is not None:
            speedup, bound = base / (ran[label] + 1), "<="
        elif mine is not None:
            speedup, bound = (base_ran + 1) / mine, ">="
        rows.append(
            {"run": label, "round": mine, "rounds_run": ran[label], "speedup": speedup, "bound": bound}
        )
    return rows
