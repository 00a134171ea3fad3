"""The processes a fedpeft command started, ended with it however it stops.

``fedpeft serve``, ``fedpeft superlink`` and ``fedpeft join`` start Flower's processes,
and those start more: a SuperLink its SuperExec (in a session of its own) and that the
ServerApp; a node its SuperExec, a fork server, a ClientApp process per message and a
worker that outlives that process (also in a session of its own). Nothing makes them
die with the command by itself (``kill PID`` of a ``fedpeft serve`` would leave its
SuperLink holding the port). :class:`CommandProcesses` is the one place that owns them:

- the command's environment gets a token (:data:`OWNERS`) that every process it starts
  inherits, and their children in turn (Flower passes its environment on): the command
  finds all of them by it, also those that left its process tree (their parent exited,
  e.g. a node's worker) or its session;
- SIGTERM, SIGINT and SIGHUP raise :class:`Stopped` in the command's main thread, so its
  ``finally`` blocks run (a run's log follower stopped, the SuperLink stopped); on leaving,
  every process that carries the token, and its descendants, gets SIGTERM, and SIGKILL
  after :data:`GRACE` seconds, until none is left (a process started meanwhile too);
- the command stops as on SIGHUP when its parent dies, e.g. the shell it runs in is
  killed (``PR_SET_PDEATHSIG``, Linux);
- the processes it starts itself (:func:`popen`) get SIGTERM when the command dies, even
  by SIGKILL, which nothing can catch (``PR_SET_PDEATHSIG`` again); a SuperLink or a
  SuperNode so stopped stops its own children.

A step that must not be cut in the middle holds the stop until its end
(:func:`deferred_stop`): ``fedpeft serve`` submitting a run, whose id it needs to stop it.

A stop signal ignored when the command started stays ignored: under ``nohup`` (SIGHUP
ignored) the command outlives its shell, and a script's background job (SIGINT ignored)
is not stopped by Ctrl-C in the terminal. SIGTERM always stops it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import psutil

#: The environment variable that lists the tokens of the commands a process was started by.
OWNERS = "FEDPEFT_PROCESS_OWNERS"
#: The signals that stop a command.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: Seconds between SIGTERM and SIGKILL.
GRACE = 3.0
#: Sweeps for processes started while the previous ones were being ended.
SWEEPS = 4

_PR_SET_PDEATHSIG, _PR_GET_PDEATHSIG = 1, 2  # linux/prctl.h
_held: list[int] | None = None  # the stop signals held by deferred_stop, while one is open


class Stopped(KeyboardInterrupt):
    """A stop signal (SIGTERM, SIGINT, SIGHUP) arrived; raised in the main thread.
    A :class:`KeyboardInterrupt`, so code that handles Ctrl-C handles every stop."""

    def __init__(self, signum: int):
        self.signum = int(signum)
        super().__init__(self.name)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """The shell's code for a command ended by this signal."""
        return 128 + self.signum


def _stop(signum: int, frame) -> None:
    """The stop signals' handler inside :class:`CommandProcesses`."""
    if _held is not None:
        _held.append(signum)
        return
    raise Stopped(signum)


@contextlib.contextmanager
def deferred_stop() -> Iterator[None]:
    """A stop signal that arrives inside takes effect at its end (:class:`Stopped` then,
    in place of any other exception): for a short step that must not be cut in the
    middle. Inside :class:`CommandProcesses` only (elsewhere Ctrl-C interrupts as ever)."""
    global _held
    outer, _held = _held, []
    try:
        yield
    finally:
        held, _held = _held, outer
        if held and outer is not None:
            outer.extend(held)
        elif held:
            raise Stopped(held[0])


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_prctl = _load_prctl()  # resolved once: a forked child calls it before exec


def _set_parent_death_signal(signum: int) -> bool:
    """Have the kernel send ``signum`` to this process when its parent dies (0: never)."""
    return _prctl is not None and _prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0


def _parent_death_signal() -> int:
    if _prctl is None:
        return 0
    value = ctypes.c_int(0)
    _prctl(_PR_GET_PDEATHSIG, ctypes.addressof(value), 0, 0, 0)
    return value.value


def _die_with_parent() -> None:  # a child's, between fork and exec
    _set_parent_death_signal(signal.SIGTERM)


def flower_env(home: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a Flower process: its own FLWR_HOME, this venv's scripts first
    on PATH (Flower starts its helpers by name), and nothing that phones home."""
    home.mkdir(parents=True, exist_ok=True)
    bindir = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
        "FLWR_HOME": str(home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        # how often a node's SuperExec looks for a message to run (a user's setting stands)
        "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": os.environ.get("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.2"),
        "PYTHONUNBUFFERED": "1",
        **(extra or {}),
    }


def script(name: str) -> str:
    """The path of this environment's console script ``name`` (Flower's CLI), else the name."""
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


def popen(cmd: list[str], **kwargs) -> subprocess.Popen:
    """``subprocess.Popen``, whose process gets SIGTERM when this one dies. Only for a
    process started from the main thread: the kernel sends the signal when the *thread*
    that started the process ends, and the main thread ends with the process alone."""
    if _prctl is not None and threading.current_thread() is threading.main_thread():
        kwargs.setdefault("preexec_fn", _die_with_parent)
    return subprocess.Popen(cmd, **kwargs)  # noqa: S603 - the caller's command


def descendants(pid: int) -> list[psutil.Process]:
    """The processes below ``pid`` now (children, theirs, ...); none if it is gone."""
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).children(recursive=True)
    return []


def end(processes: Iterable[psutil.Process], grace: float = GRACE) -> None:
    """SIGTERM to every process of ``processes`` at once, SIGKILL to those still there after
    ``grace`` seconds; returns once they are gone (or reaped, for this process's children)."""
    signalled = []
    for proc in processes:
        with contextlib.suppress(psutil.NoSuchProcess):  # psutil checks the pid was not reused
            proc.terminate()
            signalled.append(proc)
    _, alive = psutil.wait_procs(signalled, timeout=grace)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=grace)


def end_tree(proc: subprocess.Popen, grace: float = GRACE) -> None:
    """End ``proc`` and everything below it, collected before any is signalled (a child
    whose parent is gone no longer shows under it); reap ``proc``."""
    if proc.poll() is None:
        with contextlib.suppress(psutil.NoSuchProcess):
            end([psutil.Process(proc.pid), *descendants(proc.pid)], grace)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace)


class CommandProcesses:
    """The processes a command starts while inside this context: all of them (and theirs)
    are ended on leaving it, however it is left. Inside, SIGTERM, SIGINT and SIGHUP (and
    the death of the command's parent, as SIGHUP) raise :class:`Stopped` in the main
    thread. The process's signal handlers, parent-death signal and environment are as
    before once it is left (a test may run a command in its own process).

        try:
            with CommandProcesses():
                ...  # start processes, follow them
        except Stopped as stop:
            ...  # everything ended; say so, exit with stop.exit_code
    """

    def __init__(self, grace: float = GRACE):
        self.grace = grace
        self.token = f"{os.getpid()}-{secrets.token_hex(6)}"
        self._environ: str | None = None
        self._handlers: dict[int, object] = {}
        self._death_signal: int | None = None

    # ------------------------------------------------------------ entering
    def __enter__(self) -> CommandProcesses:
        try:
            self._enter()
        except BaseException:  # a signal already (a parent gone before it was watched)
            self._restore()
            raise
        return self

    def _enter(self) -> None:
        self._environ = os.environ.get(OWNERS)
        os.environ[OWNERS] = f"{self._environ} {self.token}" if self._environ else self.token
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread handles signals; the processes are still ended on leaving
        for signum in STOP_SIGNALS:
            previous = signal.getsignal(signum)
            if previous is signal.SIG_IGN and signum != signal.SIGTERM:
                continue  # nohup's SIGHUP, a background job's SIGINT: left ignored
            self._handlers[signum] = previous
            signal.signal(signum, _stop)
        if signal.SIGHUP in self._handlers:  # not under nohup: the command ends with its parent
            parent, previous = os.getppid(), _parent_death_signal()
            if _set_parent_death_signal(signal.SIGHUP):
                self._death_signal = previous
                if os.getppid() != parent:  # the parent died before the kernel watched it
                    signal.raise_signal(signal.SIGHUP)

    # ------------------------------------------------------------ leaving
    def __exit__(self, *exc) -> None:
        for signum in self._handlers:  # a second Ctrl-C must not cut the teardown short
            signal.signal(signum, signal.SIG_IGN)
        try:
            self.end_all()
        finally:
            self._restore()

    def _restore(self) -> None:
        if self._death_signal is not None:
            _set_parent_death_signal(self._death_signal)
            self._death_signal = None
        for signum, handler in self._handlers.items():
            signal.signal(signum, handler)
        self._handlers = {}
        if self._environ is None:
            os.environ.pop(OWNERS, None)
        else:
            os.environ[OWNERS] = self._environ

    def owned(self) -> list[psutil.Process]:
        """Every process alive that this command started, directly or not: those whose
        environment carries its token, and their descendants."""
        me = os.getpid()
        found: dict[int, psutil.Process] = {}
        for proc in psutil.process_iter(["environ"], ad_value=None):
            env = proc.info["environ"] or {}
            if proc.pid != me and self.token in env.get(OWNERS, "").split():
                found[proc.pid] = proc
        for proc in list(found.values()):  # a child given an environment of its own
            for child in descendants(proc.pid):
                found.setdefault(child.pid, child)
        found.pop(me, None)
        return list(found.values())

    def end_all(self) -> None:
        """End every process this command started (:meth:`owned`), sweeping again for
        those started meanwhile (a SuperExec may start a ServerApp as it is signalled)."""
        for _ in range(SWEEPS):
            procs = [p for p in self.owned() if _alive(p)]
            if not procs:
                return
            end(procs, self.grace)


def _alive(proc: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return proc.status() != psutil.STATUS_ZOMBIE
    return False
