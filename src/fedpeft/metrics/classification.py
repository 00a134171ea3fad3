"""Classification scores (accuracy, macro-F1, Matthews correlation) and their spread."""

from __future__ import annotations

import numpy as np
import torch

from fedpeft.data.task import Encoded, eval_batches, make_batch


@torch.no_grad()
def logits(
    model: torch.nn.Module, data: Encoded, batch_size: int = 128, batch_tokens: int | None = None
) -> torch.Tensor:
    """The outputs of ``model`` (in eval mode) over ``data``, in order, on the CPU: ``(N, C)``
    for classification. What :func:`predict` takes the arg-max of, and what a loaded
    export (:func:`fedpeft.load_export`) returns for texts. Batches of at most
    ``batch_size`` rows and ``batch_tokens`` tokens (:func:`fedpeft.data.task.eval_batches`)."""
    model.eval()
    out = []
    for rows in eval_batches(data.lengths, batch_size, batch_tokens):
        out.append(model(**make_batch(data, rows)).cpu())
    return torch.cat(out) if out else torch.zeros(0)


def predict(
    model: torch.nn.Module, data: Encoded, batch_size: int = 128, batch_tokens: int | None = None
) -> np.ndarray:
    """Arg-max predictions of ``model`` over ``data``, in order."""
    if len(data) == 0:
        return np.zeros(0, dtype=np.int64)
    return logits(model, data, batch_size, batch_tokens).argmax(-1).numpy()


def scores(preds: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """accuracy, macro-F1 (over the labels present in either array) and MCC."""
    # imported here: scikit-learn takes a second to import, and a deployed client's
    # process (one per message) usually only trains
    from sklearn.metrics import f1_score, matthews_corrcoef

    if len(labels) == 0:
        return {"accuracy": float("nan"), "macro_f1": float("nan"), "mcc": float("nan")}
    return {
        "accuracy": float(np.mean(preds == labels)),
        "macro_f1": float(f1_score(labels, preds, average="macro", zero_division=0)),
        "mcc": float(matthews_corrcoef(labels, preds)),
    }


def spread(per_client: list[dict[str, float]]) -> dict[str, float]:
    """Mean, standard deviation and worst decile (10th percentile) of each score."""
    out: dict[str, float] = {}
    for key in per_client[0] if per_client else []:
        values = np.array([c[key] for c in per_client], dtype=float)
        out[f"{key}_mean"] = float(np.nanmean(values))
        out[f"{key}_std"] = float(np.nanstd(values))
        out[f"{key}_p10"] = float(np.nanpercentile(values, 10))
    return out


def pooled(per_client: list[dict[str, float]], sizes: list[int]) -> dict[str, float]:
    """``accuracy_pooled``: the share of all the clients' examples scored right (each
    client's accuracy weighted by its examples), the accuracy on their union, which
    weighs a client as the data does where ``*_mean`` weighs clients alike; {} without
    accuracies."""
    if not per_client or "accuracy" not in per_client[0] or not sum(sizes):
        return {}
    right = sum(c["accuracy"] * n for c, n in zip(per_client, sizes, strict=True))
    return {"accuracy_pooled": float(right / sum(sizes))}


def mean_scores(per_client: list[dict[str, float]]) -> dict[str, float]:
    """The mean of each score over clients."""
    return {k: float(np.nanmean([c[k] for c in per_client])) for k in per_client[0]}
