"""The run's log file, ``output_dir/fedpeft.log``, and errors told in one line.

The terminal shows a live line and, when a run fails, one line saying what failed. The
log file keeps what a user may need afterwards: when each start or resume began, each
round's summary, what a resume skipped, the clients a round dropped or reset, and every
error's full traceback.
"""

from __future__ import annotations

import logging
import traceback
from pathlib import Path

from fedpeft.config.secrets import scrub

LOG_FILE = "fedpeft.log"
PACKAGE = Path(__file__).resolve().parents[1]  # src/fedpeft


class Scrubbed(logging.Formatter):
    """A record formatted, traceback included, with its credentials redacted
    (:func:`fedpeft.config.secrets.scrub`)."""

    def format(self, record: logging.LogRecord) -> str:
        return scrub(super().format(record))


def open_log(out: Path) -> logging.Logger:
    """The logger writing (appending) to ``out/fedpeft.log``; one handler however often
    it is opened. No credential is written (:class:`Scrubbed`)."""
    out.mkdir(parents=True, exist_ok=True)
    path = (out / LOG_FILE).resolve()
    log = logging.getLogger(f"fedpeft.run.{path}")
    log.setLevel(logging.INFO)
    log.propagate = False
    if not log.handlers:
        handler = logging.FileHandler(path, encoding="utf-8")
        handler.setFormatter(Scrubbed("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(handler)
    return log


def close_log(log: logging.Logger) -> None:
    for handler in list(log.handlers):
        handler.close()
        log.removeHandler(handler)


def _ours(filename: str) -> bool:
    return Path(filename).resolve().is_relative_to(PACKAGE)


def _where(frame: traceback.FrameSummary) -> str:
    path = Path(frame.filename).resolve()
    shown = f"fedpeft/{path.relative_to(PACKAGE)}" if _ours(frame.filename) else path.name
    return f"{shown}:{frame.lineno} ({frame.name})"


def is_expected(err: BaseException) -> bool:
    """Whether ``err`` is one that fedpeft raises on purpose with a message for the user: a
    class of fedpeft's own, a missing file, or an error raised by fedpeft's code itself."""
    if type(err).__module__.startswith("fedpeft") or isinstance(err, FileNotFoundError):
        return True
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and _ours(frames[-1].filename)


def one_line(err: BaseException) -> str:
    """What failed, in one line: the message of an expected error; for any other, its type,
    where it was raised and the last place in fedpeft's code that led there. No credential
    is told (:func:`fedpeft.config.secrets.scrub`)."""
    message = scrub(" ".join(str(err).split())) or "(no message)"
    if is_expected(err):
        return message
    frames = traceback.extract_tb(err.__traceback__)
    where = f" at {_where(frames[-1])}" if frames else ""
    ours = [f for f in frames if _ours(f.filename)]
    via = f", called from {_where(ours[-1])}" if ours and ours[-1] is not frames[-1] else ""
    return f"unexpected {type(err).__name__}{where}{via}: {message}"
