"""The output directory of a run and how to read it back.

DIR/config.yaml      the fully resolved config the run used
DIR/metrics.jsonl    one JSON object per completed round
DIR/summary.json     final and best scores, bytes, parameter counts, times
DIR/*.png            accuracy vs round and vs cumulative bytes; partition heatmap; client
                     drift vs round (eval.drift)
DIR/checkpoint.pt    last completed round (for --resume)
DIR/adapter/         the exported global adapter
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


def _clean(value):
    """JSON-safe values: NaN/inf become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_clean(data), indent=2) + "\n")
    os.replace(tmp, path)


def write_records(path: Path, records: list[dict]) -> None:
    """(Re)write metrics.jsonl from the records (used at start and on resume)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(_clean(r)) + "\n" for r in records))
    os.replace(tmp, path)


def append_record(path: Path, record: dict) -> None:
    with path.open("a") as fh:
        fh.write(json.dumps(_clean(record)) + "\n")


def read_records(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not a fedpeft run directory (no metrics.jsonl)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_summary(run_dir: Path) -> dict:
    path = Path(run_dir) / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: run not finished (no summary.json)")
    return json.loads(path.read_text())


#: The score a run is judged by, the first of these its records hold (all higher-is-better):
#: accuracy for classification, ROUGE-L for generation, entity F1 for NER, F1 for QA.
HEADLINES = ("accuracy", "rouge_l", "entity_f1", "f1")


def headline(records_or_scores: list[dict] | dict) -> str:
    """The headline score's name for a run's records (or one set of scores)."""
    items = records_or_scores if isinstance(records_or_scores, list) else [{"global": records_or_scores}]
    for r in items:
        for name in HEADLINES:
            if name in (r.get("global") or {}) or f"{name}_mean" in (r.get("local") or {}):
                return name
    return HEADLINES[0]


def summarize(records: list[dict], extra: dict) -> dict:
    """Final and best scores plus totals over the records of a finished run; "best" by
    the headline score (``best_global_<name>``; ``headline`` says which)."""
    evaluated = [r for r in records if "global" in r or "local" in r]
    final = evaluated[-1] if evaluated else {}
    name = headline(records)
    scored = [r for r in evaluated if "global" in r]  # none in the cross-silo setting (no global test)
    best = max(scored, key=lambda r: r["global"][name], default={})
    last = records[-1]
    return {
        **extra,
        "rounds": last["round"],
        "final_global": final.get("global"),
        "final_local": final.get("local"),
        "final_val": final.get("val"),
        "final_local_by_client": final.get("local_by_client"),
        "headline": name,
        f"best_global_{name}": best.get("global", {}).get(name),
        "best_round": best.get("round"),
        "total_bytes_down": last["cum_bytes_down"],
        "total_bytes_up": last["cum_bytes_up"],
        "total_bytes": last["cum_bytes"],
        "time_train": sum(r["time_train"] for r in records),
        "time_aggregate": sum(r["time_aggregate"] for r in records),
        "time_eval": sum(r["time_eval"] for r in records),
        "setup": records[0].get("setup", {}),  # one-off server set-up (e.g. time_decompose)
    }


#: The results table's score columns per headline score: (column title, score key).
SCORE_COLUMNS = {
    "accuracy": [("acc", "accuracy"), ("F1", "macro_f1"), ("MCC", "mcc")],
    "rouge_l": [("ROUGE-L", "rouge_l"), ("BLEU", "bleu"), ("chrF", "chrf"), ("ppl", "perplexity")],
    "entity_f1": [("entity F1", "entity_f1"), ("P", "entity_precision"), ("R", "entity_recall")],
    "f1": [("F1", "f1"), ("EM", "exact_match")],
}


def results_table(summaries: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The results table of finished runs as text cells, (header, rows): per run its
    rounds, final global scores, mean ± std of the clients' local headline score, best
    global headline score @ its round, MB sent and training seconds; the method beside
    the run's name unless the name holds it."""
    name = summaries[0].get("headline", "accuracy") if summaries else "accuracy"
    columns = SCORE_COLUMNS[name]
    header = ["run", "rnds", *(t for t, _ in columns), f"local {columns[0][0]}", "best@rnd", "MB", "train s"]
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    rows = []
    for s in summaries:
        g, loc = s.get("final_global") or {}, s.get("final_local") or {}
        local = f"{fmt(loc.get(f'{name}_mean'))}±{fmt(loc.get(f'{name}_std'))}" if loc else "-"
        rnd = s.get("best_round")  # none without a global test set (the cross-silo setting)
        best = "-" if rnd is None else f"{fmt(s.get(f'best_global_{name}'))}@{rnd}"
        run_name = s["name"] if s["method"] in s["name"] else f"{s['name']} ({s['method']})"
        scores = [fmt(g.get(key)) for _, key in columns]
        sent, trained = f"{s['total_bytes'] / 1e6:.2f}", f"{s['time_train']:.1f}"
        rows.append([run_name, str(s["rounds"]), *scores, local, best, sent, trained])
    return header, rows
