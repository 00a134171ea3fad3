"""The benchmarks' run records: one JSON-lines file per benchmark, one row per run.

A benchmark's run trains in its directory under ``benchmarks/results/<benchmark>/`` (outside
git: checkpoints, plots, exports); once finished, its record is a row of
``benchmarks/results/<benchmark>.jsonl.gz`` (in git; gzip, written without a timestamp, so
the same rows give the same bytes: per-round records compress about fourfold, and the
working tree stays small enough to carry to a GPU machine), keyed by the run directory's
path relative to ``benchmarks/results``::

    {"run": "c2a/fedft-beta5-seed0", "fingerprint": "...", "config": {...},
     "summary": {...}, "records": [{...}, ...]}

``config`` is the run's whole resolved config (its ``config.yaml``: an option it lacks
was added after it ran, which ``tuning.made_the_old_way`` reads), ``fingerprint`` that
config's :func:`fedpeft.experiment.fingerprint` when the row was written, ``summary``
its ``summary.json`` and ``records`` its ``metrics.jsonl``, one per round. A run that
diverged is ``{"run", "fingerprint", "diverged": why}``. A run directory outside
``benchmarks/results`` (a benchmark given another ``--out``) keeps its row in
``records.jsonl.gz`` beside it. ``zcat FILE | head -c 300`` shows a file's first row.

One process writes a file at a time (a lock beside it), replacing it whole; readers
read without the lock. The commands::

    python benchmarks/records.py convert [DIR ...]  # finished run directories into their files
    python benchmarks/records.py drop RUN ...       # forget runs (and their directories), to re-run them
    python benchmarks/records.py unpack RUN ...     # write runs back as directories (for fedpeft report)
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gzip
import json
import os
import shutil
from pathlib import Path

import yaml

from fedpeft.config import parse_config
from fedpeft.experiment import fingerprint
from fedpeft.report.results import write_json, write_records

RESULTS = (Path(__file__).parent / "results").resolve()
SUFFIX = ".jsonl.gz"  # a benchmark's file: its name and this
DIVERGED = "diverged.json"  # where a run directory recorded its divergence before the files

_loaded: dict[Path, tuple[tuple, dict[str, str]]] = {}  # file -> (its stat, {run: row's line})


def locate(out: Path) -> tuple[Path, str]:
    """``(the file that holds the run in out, its key there)``."""
    out = Path(out).resolve()
    if out.is_relative_to(RESULTS) and out != RESULTS:
        key = out.relative_to(RESULTS)
        return RESULTS / f"{key.parts[0]}{SUFFIX}", key.as_posix()
    return out.parent / f"records{SUFFIX}", out.name


def row(out: Path) -> dict | None:
    """The stored row of the run in ``out``, or None."""
    store, key = locate(out)
    line = _lines(store).get(key)
    return None if line is None else json.loads(line)


def read_records(out: Path) -> list[dict]:
    """The per-round records of the finished run in ``out`` (as ``metrics.jsonl`` held them)."""
    return _finished(out)["records"]


def read_summary(out: Path) -> dict:
    """The summary of the finished run in ``out`` (as ``summary.json`` held it)."""
    return _finished(out)["summary"]


def _finished(out: Path) -> dict:
    found = row(out)
    if found is None or "summary" not in found:
        store, key = locate(out)
        raise FileNotFoundError(f"{store}: no finished run {key}")
    return found


def finished_row(out: Path) -> dict:
    """The row of the finished run in the directory ``out``."""
    raw = yaml.safe_load((out / "config.yaml").read_text())
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {
        "run": locate(out)[1],
        "fingerprint": fingerprint(parse_config(raw, str(out / "config.yaml"))),
        "config": raw,
        "summary": json.loads((out / "summary.json").read_text()),
        "records": [json.loads(line) for line in lines if line.strip()],
    }


def unpack(out: Path) -> None:
    """Write the finished run of ``out`` back into that directory, laid out as
    ``fedpeft.experiment.run`` wrote it (config.yaml, metrics.jsonl, summary.json)."""
    found = _finished(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(found["config"], sort_keys=False))
    write_records(out / "metrics.jsonl", found["records"])
    write_json(out / "summary.json", found["summary"])


def diverged_row(out: Path, fingerprint: str, why: str) -> dict:
    """The row of a run in ``out`` of the config of ``fingerprint`` that diverged."""
    return {"run": locate(out)[1], "fingerprint": fingerprint, "diverged": why}


def put(out: Path, new: dict) -> dict:
    """Store ``new`` as the row of the run in ``out`` (replacing one there); ``new``."""
    store, key = locate(out)
    _update(store, {key: new})
    return new


def drop(out: Path) -> bool:
    """Forget the run in ``out`` and remove its directory; whether it was stored."""
    store, key = locate(out)
    shutil.rmtree(out, ignore_errors=True)
    return _update(store, {key: None})


def _update(store: Path, rows: dict[str, dict | None]) -> bool:
    """Write ``rows`` (a None: that run removed) into ``store``, one writer at a time;
    whether any was there before."""
    store.parent.mkdir(parents=True, exist_ok=True)
    with _lock(store):
        lines = dict(_lines(store))
        had = any(key in lines for key in rows)
        for key, new in rows.items():
            if new is None:
                lines.pop(key, None)
            else:
                lines[key] = _line(new)
        tmp = store.with_name(store.name + ".tmp")
        with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as packed:
            packed.write("".join(line + "\n" for line in lines.values()).encode())
        os.replace(tmp, store)
        stat = store.stat()
        _loaded[store] = ((stat.st_ino, stat.st_mtime_ns, stat.st_size), lines)
    return had


def _line(new: dict) -> str:
    """A row as one line, its run first (what a reader of the file looks for)."""
    return json.dumps({"run": new["run"], **new}, separators=(",", ":"))


@contextlib.contextmanager
def _lock(store: Path):
    with open(store.parent / f".{store.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _lines(store: Path) -> dict[str, str]:
    """``{run: its row's line}`` of ``store`` (empty when there is none), read again only
    when the file changed."""
    try:
        stat = store.stat()
    except FileNotFoundError:
        return {}
    seen = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
    if _loaded.get(store, (None,))[0] != seen:
        with gzip.open(store, "rt", encoding="utf-8") as packed:
            lines = packed.read().splitlines()
        _loaded[store] = (seen, {json.loads(line)["run"]: line for line in lines if line.strip()})
    return _loaded[store][1]


def convert(roots: list[Path]) -> int:
    """Store every run directory under ``roots`` (finished, or diverged), one file write
    per benchmark; a row whose config does not parse back to its fingerprint stops it.
    The number of runs stored."""
    by_store: dict[Path, dict[str, dict]] = {}
    outs = {p.parent for root in roots for name in ("summary.json", DIVERGED) for p in root.rglob(name)}
    for out in sorted(outs):
        if (out / "summary.json").is_file():
            new = finished_row(out)
            if fingerprint(parse_config(json.loads(_line(new))["config"])) != new["fingerprint"]:
                raise SystemExit(f"{out}: its config does not parse back to its fingerprint")
        else:
            recorded = json.loads((out / DIVERGED).read_text())
            new = diverged_row(out, recorded["fingerprint"], recorded["error"])
        store, key = locate(out)
        by_store.setdefault(store, {})[key] = new
    for store, rows in by_store.items():
        _update(store, rows)
        print(f"{store}: {len(rows)} runs")
    return sum(len(rows) for rows in by_store.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="store the run directories under DIR (default: every benchmark's)")
    conv.add_argument("dirs", nargs="*", type=Path)
    for name, what in (("drop", "forget runs"), ("unpack", "write runs back into their directories")):
        named = sub.add_parser(name, help=f"{what}, named by directory (benchmarks/results/c2a/lora-s0)")
        named.add_argument("runs", nargs="+", type=Path)
    args = ap.parse_args()
    if args.command == "convert":
        roots = args.dirs or sorted(p for p in RESULTS.iterdir() if p.is_dir())
        print(f"{convert(roots)} runs stored")
    for out in getattr(args, "runs", []):
        store, key = locate(out)
        if args.command == "unpack":
            unpack(out)
            print(f"{out}: {key} of {store}")
        else:
            print(f"{store}: {key} {'dropped' if drop(out) else 'was not there'}")


if __name__ == "__main__":
    main()
