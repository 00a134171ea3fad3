"""Will the run fit in memory? A probe before the first round, and the readings it takes.

A run that does not fit is killed by the operating system (or dies of a CUDA
out-of-memory error) after minutes or hours, often after its first round, with nothing
said about which setting to lower. :func:`check_memory` measures, before the first
round, the peak memory of one local step of the largest client on its longest rows and
of one scoring batch, and raises :class:`InsufficientMemory` naming what the run needs,
what the machine has and which keys lower it, when the estimate exceeds what is free.

Readings: on the CPU, the process's resident memory (``VmRSS``) and its high-water mark
(``VmHWM``, reset by writing ``5`` to ``/proc/self/clear_refs``) against ``MemAvailable``
(and a cgroup v2 limit, when one is set); on CUDA, the allocator's peak against
``torch.cuda.mem_get_info``. Where neither can be read (no ``/proc``), the check
skips and says so. ``FEDPEFT_MEMORY_LIMIT_MB`` (or the ``limit_mb`` argument) stands in
for the memory the machine has, in MiB: a test, or a user who wants to leave room for
something else.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import itertools
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from fedpeft.data.split import Clients
from fedpeft.data.task import Encoded
from fedpeft.engines.local import RoundContext, SampleDP, cohort_mode, fold_refusal
from fedpeft.methods.base import ClientData, Job, Method, ServerState
from fedpeft.metrics.scorers import OneAtATime, Scorer
from fedpeft.tensors import Tensors

if TYPE_CHECKING:
    from fedpeft.config import TrainConfig

MIB = 2**20
GIB = 2**30
#: The share of what the machine has that a run may plan to use (the rest: fragmentation,
#: the round's other tensors, whatever else runs).
HEADROOM = 0.9
DEVICE_NAMES = {"cpu": "machine", "cuda": "GPU"}
#: The rows of the smallest probe step (Per-FedAvg splits a batch in two).
BASE_ROWS = 4
PROC_STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")
MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")
LIMIT_ENV = "FEDPEFT_MEMORY_LIMIT_MB"


class InsufficientMemory(RuntimeError):
    """The run's estimated peak memory exceeds what the machine has (see the message)."""


class Counts(Protocol):
    """What the probes read of the experiment's counts (the engine's ``plan``)."""

    eval_batch_size: int
    clients_per_round: int


class ProbedEngine(Protocol):
    """What the probes read of the engine whose run they measure (the in-process engine):
    its model, method and clients, how it scores and trains, and its hold on the model."""

    model: torch.nn.Module
    method: Method
    clients: Sequence[ClientData]
    scorer: Scorer
    plan: Counts
    cohort_size: int
    train: TrainConfig
    sample_dp: SampleDP | None

    def probed_state(self, client: ClientData) -> Tensors: ...

    def load(self, tensors: Tensors) -> None: ...

    def forget_loaded(self) -> None: ...


# ---------------------------------------------------------------- CPU readings (Linux)


def _status_bytes(key: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes; None without /proc."""
    try:
        text = PROC_STATUS.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return None


def rss() -> int | None:
    """This process's resident memory now, in bytes (None where it cannot be read)."""
    return _status_bytes("VmRSS")


def peak_rss() -> int | None:
    """This process's resident high-water mark (since start or :func:`reset_peak_rss`)."""
    return _status_bytes("VmHWM")


def reset_peak_rss() -> bool:
    """Reset the high-water mark to the current resident memory; False where unsupported."""
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def available_ram() -> int | None:
    """Bytes this process may still take: ``MemAvailable``, or less when a cgroup v2
    limit (``memory.max``) leaves less room; None without /proc."""
    try:
        fields = dict(line.split(":", 1) for line in MEMINFO.read_text().splitlines())
        free = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    limit, used = _read_int(CGROUP / "memory.max"), _read_int(CGROUP / "memory.current")
    if limit is not None and used is not None:  # "max" (no limit) reads as None
        free = min(free, max(limit - used, 0))
    return free


def measure_peak_rss(run: Callable[[], object]) -> int | None:
    """The growth of resident memory at its peak while ``run()`` runs, above the resident
    memory before it, in bytes; None where it cannot be measured."""
    before = rss()
    if before is None or not reset_peak_rss():
        return None
    run()
    peak = peak_rss()
    return None if peak is None else max(peak - before, 0)


# ---------------------------------------------------------------- CUDA readings


def measure_peak_cuda(run: Callable[[], object], device: torch.device) -> int:
    """The growth of CUDA memory allocated at its peak while ``run()`` runs, in bytes."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def release_free_heap() -> None:
    """Return the C heap's free memory to the system (glibc's ``malloc_trim``), so that
    resident memory counts what is in use; elsewhere a no-op."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# ---------------------------------------------------------------- the check


def _limit_bytes(limit_mb: float | None) -> int | None:
    """The memory a run may use, when given (argument, else ``FEDPEFT_MEMORY_LIMIT_MB``)."""
    if limit_mb is None and os.environ.get(LIMIT_ENV):
        limit_mb = float(os.environ[LIMIT_ENV])
    return None if limit_mb is None else int(limit_mb * MIB)


def _longest(data: Encoded, rows: int) -> Encoded:
    """``rows`` rows of ``data``, the longest first (repeated when it has fewer)."""
    order = torch.argsort(data.lengths.cpu(), descending=True, stable=True)
    return data.subset(order[torch.arange(rows) % len(order)])


def probe_copy(method: Method, model: torch.nn.Module) -> Method:
    """A copy of ``method`` for a probe to train with: its own counters, caches and
    round bookkeeping (a probe's steps must leave the run's method as it was), sharing
    ``model``'s modules, parameters and buffers rather than copying them. A hook set on
    the instance (a wrapper that logs or spies) may close over the run's method itself,
    so the copy runs its class's own hooks."""
    shared = itertools.chain(model.modules(), model.parameters(), model.buffers())
    clone = copy.deepcopy(method, {id(obj): obj for obj in shared})
    for name, value in list(vars(clone).items()):
        if callable(value) and callable(getattr(type(clone), name, None)):
            delattr(clone, name)
    return clone


class _Probe:
    """One local step and one scoring batch of an engine's largest client, on its longest
    rows, at any number of rows and clients; each returns the peak memory it took (as
    ``measure(run)`` gives it, when given: a test's stand-in)."""

    def __init__(
        self,
        engine: ProbedEngine,
        server: ServerState,
        measure: Callable[[Callable[[], object]], int | None] | None = None,
    ):
        self.engine, self.model, self.measure = engine, engine.model, measure
        self.method = probe_copy(engine.method, engine.model)
        self.device = next(engine.model.parameters()).device
        clients = engine.clients
        self.client = (
            clients.largest() if isinstance(clients, Clients) else max(clients, key=lambda c: len(c.train))
        )
        # what the client would be sent and what it holds, as its next round would pair
        # them (a resumed run's client may hold state its downlink then leaves out)
        self.received = self.method.downlink(server, self.client.cid)
        self.personal = engine.probed_state(self.client)
        self.state = self.method.eval_state(engine.model, self.received, self.personal, self.client)
        self.longest = int(self.client.train.lengths.max())
        scorer = engine.scorer
        self.score_size = getattr(scorer, "batch_size", engine.plan.eval_batch_size)
        tokens = getattr(scorer, "batch_tokens", None)
        if tokens is not None:
            self.score_size = max(1, min(self.score_size, tokens // self.longest))
        self.score_clients = 1 if isinstance(scorer, OneAtATime) else engine.cohort_size
        self.step_size = min(engine.train.batch_size, len(self.client.train))

    def peak(self, run: Callable[[], object]) -> int | None:
        if self.measure is not None:
            return self.measure(run)
        if self.device.type == "cuda":
            return measure_peak_cuda(run, self.device)
        release_free_heap()
        return measure_peak_rss(run)

    def jobs(self, clients: int, rows: int, **train) -> list[Job]:
        """One local step's jobs for ``clients`` clients of ``rows`` rows each (``train``:
        other settings of the step)."""
        client = ClientData(self.client.cid, _longest(self.client.train, rows), self.client.test)
        one_step = self.engine.train.model_copy(update={"local_steps": 1, "batch_size": rows, **train})
        context = RoundContext(one_step, self.engine.sample_dp)
        return [Job(self.received, self.personal, client, 0, context=context)] * clients

    def step(self, clients: int, rows: int) -> int | None:
        """One local step of ``clients`` clients of ``rows`` rows each."""
        jobs = self.jobs(clients, rows)
        return self.peak(lambda: self.method.fit_cohort(self.model, jobs))

    def seconds(self, clients: int, mode: str, repeats: int = 3) -> float:
        """The fastest of ``repeats`` timed local steps (after one untimed) of a cohort of
        ``clients`` clients of a full batch each, trained as ``mode`` (vmap or folded)."""
        jobs = self.jobs(clients, self.step_size, cohort_mode=mode)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda *a: None)
        times = []
        for _ in range(repeats + 1):
            sync(self.device)
            start = time.perf_counter()
            self.method.fit_cohort(self.model, jobs)
            sync(self.device)
            times.append(time.perf_counter() - start)
        return min(times[1:])

    def score(self, clients: int, rows: int) -> int | None:
        """One scoring batch of ``rows`` rows for each of ``clients`` clients' models."""
        data = _longest(self.client.train, rows)
        engine = self.engine
        return self.peak(
            lambda: engine.scorer.score_clients(
                self.model, [self.state] * clients, [data] * clients, engine.load
            )
        )


def _line(p: tuple[int, int], q: tuple[int, int], at: int) -> int:
    """The peak at ``at`` rows on the line through the probes ``p`` and ``q`` ``(rows,
    peak)``, its slope at least 0."""
    slope = max(q[1] - p[1], 0) / (q[0] - p[0])
    return int(q[1] + slope * (at - q[0]))


def _estimate(
    measure: Callable[[int, int], int | None], clients: int, rows: int, room: int
) -> tuple[int | None, str]:
    """The peak of ``measure(clients, rows)`` and how it was found. First one client and
    a few rows (:data:`BASE_ROWS`: a method may split a batch): that peak, one-time costs
    included, scaled to the rows x clients bounds the full one from above (``bounded``),
    which settles a small run. Else measured on one
    client at an eighth and a quarter of the rows and extrapolated linearly in rows x
    clients (``extrapolated``): far within ``room`` (a quarter), that settles it; within
    half of it, a full-size probe does (``measured``); beyond, a full-size probe might
    not fit, so one more probe, at the most rows the line keeps within half of ``room``,
    straightens the line before it is read (small probes overstate a batch's slope)."""
    full, base = clients * rows, min(rows, BASE_ROWS)
    one = measure(1, base)
    if one is None or full == base:
        return one, "measured" if one is not None else "unmeasured"
    if one * full / base <= room / 4:
        return int(one * full / base), "bounded"
    small = max(base, rows // 8)
    mid = max(small + 1, rows // 4)
    a, b = measure(1, small), measure(1, mid)
    if a is None or b is None:
        return None, "unmeasured"
    guess = _line((small, a), (mid, b), full)
    if guess <= room / 4:
        return guess, "extrapolated"
    if guess <= room / 2:
        measured = measure(clients, rows)
        return (guess, "extrapolated") if measured is None else (measured, "measured")
    largest = next((r for r in range(rows, mid, -1) if _line((small, a), (mid, b), r) <= room / 2), mid)
    if largest >= 2 * mid and (c := measure(1, largest)) is not None:
        return _line((mid, b), (largest, c), full), "extrapolated"
    return guess, "extrapolated"


def _room(device: torch.device, limit: int | None) -> tuple[int, int, str] | str:
    """``(held, has, source)``: what the process (CUDA: the allocator) holds now, what the
    run may use in all, and where that figure comes from; or why neither can be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_allocated(device)
        source = "the GPU's free memory and what torch holds of it"
        return held, limit if limit is not None else free + torch.cuda.memory_reserved(device), source
    if device.type != "cpu":
        return f"memory on {device.type} cannot be measured"
    held, free = rss(), available_ram()
    if held is None or (free is None and limit is None) or not reset_peak_rss():
        return "no /proc/self/status, /proc/self/clear_refs or /proc/meminfo to measure memory with"
    return held, limit if limit is not None else held + free, "MemAvailable and what this process holds"


def _either(keys: list[str]) -> str:
    return ", ".join(keys[:-1]) + f" or {keys[-1]}" if len(keys) > 1 else keys[0]


def _advice(probe: _Probe, figures: dict[str, float], clients: int) -> str:
    """What the peak is made of, and the keys that lower each part."""
    train, scorer = probe.engine.train, probe.engine.scorer
    cohort = [f"train.cohort_size (now {clients})"] if clients > 1 else []
    step_keys = [f"train.batch_size (now {train.batch_size})", "data.max_length", *cohort]
    if train.precision == "fp32":
        step_keys.append("train.precision (bf16 halves the frozen weights)")
    score_keys = [
        f"eval.batch_tokens (now {getattr(scorer, 'batch_tokens', None)})",
        f"eval.batch_size (now {getattr(scorer, 'batch_size', None)})",
        "data.max_length",
        *(cohort if probe.score_clients > 1 else []),
    ]
    rows, step, score = (
        f"rows of {probe.longest} tokens",
        figures["step_mb"] / 1024,
        figures["score_mb"] / 1024,
    )
    return (
        f"one local step of {clients} client(s) x {probe.step_size} {rows} takes {step:.1f} GiB "
        f"(lower {_either(step_keys)}); one scoring batch of {probe.score_size} {rows} takes "
        f"{score:.1f} GiB (lower {_either(score_keys)})"
    )


@contextlib.contextmanager
def probing(engine: ProbedEngine, device: torch.device) -> Iterator[None]:
    """Around a probe: the random streams, and which client's tensors the model holds,
    left as they were."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            yield
        finally:
            engine.forget_loaded()  # a scoring probe loads a client's tensors into the model


def cohort_peaks(
    engine: ProbedEngine,
    server: ServerState,
    measure: Callable[[Callable[[], object]], int | None] | None = None,
) -> tuple[int | None, int | None]:
    """The peak memory of cohorts of 1 and of 4 clients, each the larger of one local step
    and one scoring batch of the largest client's longest rows, in a round that trains
    (:meth:`~fedpeft.methods.base.Method.training_server`)."""
    device = next(engine.model.parameters()).device
    with probing(engine, device):
        probe = _Probe(engine, engine.method.training_server(server), measure)
        one, four = (
            [probe.step(n, probe.step_size), probe.score(n, probe.score_size)] for n in (1, 4)
        )  # fmt: skip
    if None in one + four:
        return None, None
    return max(one), max(four)


def check_memory(engine: ProbedEngine, server: ServerState, limit_mb: float | None = None) -> dict:
    """Whether ``engine``'s run fits in memory, checked before its first round (the
    module docstring): the peak of one local step of its largest client on its longest
    rows (a cohort of ``engine.cohort_size`` clients) and of one scoring batch (as many
    rows of that length as ``eval.batch_size`` and ``eval.batch_tokens`` allow): bounded
    from a one-row probe when that settles it, else measured on small sizes and
    extrapolated, or at full size when that decides and is safe (:func:`_estimate`).

    Returns the figures, in MiB: ``held`` (what the process holds now), ``step`` and
    ``score`` (each one's peak beyond it), ``need`` and ``has`` (what the run may use:
    ``limit_mb``, else ``FEDPEFT_MEMORY_LIMIT_MB``, else what is free plus ``held``),
    and how the peaks were found; ``{"skipped": why}`` where memory cannot be read.
    Raises :class:`InsufficientMemory` when ``need`` exceeds :data:`HEADROOM` of ``has``.
    The engine's state, its model's tensors and the random streams are left as they were."""
    device = next(engine.model.parameters()).device
    room = _room(device, _limit_bytes(limit_mb))
    if isinstance(room, str):
        return {"skipped": room}
    held, has, source = room
    if limit_mb is not None or os.environ.get(LIMIT_ENV):
        source = f"limit_mb {limit_mb}" if limit_mb is not None else f"{LIMIT_ENV}={os.environ[LIMIT_ENV]}"
    clients = engine.cohort_size
    # the first round, and the rounds that train where they differ (after Fed-SB's setup)
    trains = engine.method.training_server(server)
    steps, scores = [], []
    with probing(engine, device):
        for state in [server] if trains is server else [server, trains]:
            probe = _Probe(engine, state)
            steps.append(_estimate(probe.step, clients, probe.step_size, has - held))
            scores.append(_estimate(probe.score, probe.score_clients, probe.score_size, has - held))
    if any(peak is None for peak, _ in steps + scores):
        return {"skipped": "the probe's peak memory could not be read"}
    (step, step_how), (score, score_how) = (max(found, key=lambda e: e[0]) for found in (steps, scores))
    need = held + max(step, score)
    figures = {
        "held_mb": held / MIB,
        "step_mb": step / MIB,
        "score_mb": score / MIB,
        "need_mb": need / MIB,
        "has_mb": has / MIB,
        "step_found": step_how,
        "score_found": score_how,
    }
    if need > HEADROOM * has:
        raise InsufficientMemory(
            f"this run needs about {need / GIB:.1f} GiB of memory at its peak, and the "
            f"{DEVICE_NAMES.get(device.type, device.type)} has {has / GIB:.1f} GiB for it ({source}; "
            f"a run plans on {HEADROOM:.0%} of it): the process holds {held / GIB:.1f} GiB, and "
            f"{_advice(probe, figures, clients)}"
        )
    return figures


# ---------------------------------------------------------------- train.cohort_size: auto


def fitting_cohort(free: int, fixed: float, per_client: float, limit: int, headroom: float = 0.8) -> int:
    """The most clients (at most ``limit``, at least 1) whose cohort needs at most
    ``headroom * free`` bytes, a cohort of ``n`` needing ``fixed + n * per_client``."""
    if per_client <= 0:
        return limit
    return max(1, min(limit, int((headroom * free - fixed) // per_client)))


def probe_cohort_size(engine: ProbedEngine, server: ServerState) -> int:
    """``train.cohort_size: auto``. On a GPU: the peak memory of one local step and of
    one scoring batch for cohorts of 1 and 4 clients (:func:`~fedpeft.engines.memory.cohort_peaks`)
    gives the cost per client; the cohort is the most clients that fit 80 % of the free
    memory (at most the clients per round). Elsewhere: 1 (on a CPU, batching clients
    gains nothing)."""
    s = engine.plan
    device = next(engine.model.parameters()).device
    if device.type != "cuda" or s.clients_per_round == 1:
        return 1
    one, four = cohort_peaks(engine, server)
    per_client = (four - one) / 3
    free, _ = torch.cuda.mem_get_info(device)
    return fitting_cohort(free, one - per_client, per_client, s.clients_per_round)


# ---------------------------------------------------------------- train.cohort_mode: auto

#: devices on which ``train.cohort_mode: auto`` times a vmapped cohort against a folded one
#: (on a CPU cohorts are of one client unless asked, and the choice is left to the config)
TIMED_MODES_ON = ("cuda",)


def choose_cohort_mode(engine: ProbedEngine, server: ServerState) -> dict:
    """``train.cohort_mode: auto`` on a GPU, where the method's cohorts may vmap or fold
    (:func:`~fedpeft.engines.local.cohort_mode` would vmap, and the method folds): one local
    step of a cohort of the run's size in each mode, timed; the faster mode is the run's
    (``engine.train`` and its round pipeline's). Returns the round-1 record of why: the
    mode and both steps' seconds; nothing where there was no choice to make."""
    device = next(engine.model.parameters()).device
    method, model, dp_sgd = engine.method, engine.model, engine.sample_dp is not None
    if engine.train.cohort_mode != "auto" or engine.cohort_size < 2 or device.type not in TIMED_MODES_ON:
        return {}
    how = cohort_mode(method, model, "auto", dp_sgd, compiled=engine.train.compile).how
    if how != "vmap" or fold_refusal(method, model) or dp_sgd:
        return {}
    with probing(engine, device):
        probe = _Probe(engine, engine.method.training_server(server))
        size = min(engine.cohort_size, engine.plan.clients_per_round)
        seconds = {mode: probe.seconds(size, mode) for mode in ("vmap", "folded")}
    chosen = min(seconds, key=seconds.get)
    engine.train = engine.rounds.train = engine.train.model_copy(update={"cohort_mode": chosen})
    return {"cohort_mode": chosen, **{f"cohort_step_{mode}": s for mode, s in seconds.items()}}
