"""A stopped command stops everything it started (fedpeft.flower.processes).

``fedpeft serve``, ``fedpeft superlink`` and ``fedpeft join`` start process trees that
leave the tree (Flower's SuperExec starts in a session of its own, a node's worker
outlives the ClientApp process that started it). Stopped by SIGTERM, SIGINT or SIGHUP,
or with the shell they run in killed, none of those may be left, and the port must be
free for a new SuperLink; a run so stopped continues with ``--resume``.

- Default tier: a stand-in command whose tree has Flower's shapes (a child in a session
  of its own, an orphaned grandchild), for every signal, for its shell killed, and under
  nohup; a real ``fedpeft serve`` with TLS, waiting for its nodes, stopped by SIGTERM;
  a real ``fedpeft superlink`` and ``fedpeft join`` ended with their shells.
- Slow tier (real deployments, up to minutes each): ``fedpeft serve`` and ``fedpeft join``
  stopped in the middle of a run by each signal, and killed (SIGKILL); ``fedpeft serve
  --superlink`` stopping its run on a long-lived ``fedpeft superlink``, which is then
  stopped; a run stopped after its first round and resumed, whose final metrics are
  those of an uninterrupted run.

Every check of "ended" is: within :data:`DEADLINE` seconds of the stop, no process of
those collected with psutil before it (the whole tree, and the node's worker, which left
the tree) is alive.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from fedpeft.config import dump_config
from fedpeft.flower import deploy
from fedpeft.flower.certs import make_certificates, make_node_keys
from fedpeft.report.results import read_records

DEADLINE = 15.0  # seconds from the stop to nothing left
RUN_STOPPED = 90.0  # from `flwr stop` to the end of a ServerApp that the SuperLink started
STARTUP = 300.0  # a real deployment on a loaded 2-core machine: generous, only a limit
FEDPEFT = str(Path(sys.executable).parent / "fedpeft")


@pytest.fixture(autouse=True)
def no_leftovers(tmp_path):
    """Whatever a failed test left running under its folder is killed after it."""
    yield
    ours = []
    for proc in psutil.process_iter(["cmdline", "cwd"], ad_value=None):
        where = " ".join(proc.info["cmdline"] or []) + " " + (proc.info["cwd"] or "")
        if str(tmp_path) in where and proc.pid != os.getpid():
            ours.append(proc)
    for proc in ours:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(ours, timeout=5)


def _shell_signals() -> None:
    """A child as a terminal's shell starts it: SIGINT and SIGHUP at their defaults (a
    test runner's worker may ignore them, and ignored signals are inherited)."""
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


def _nohup_signals() -> None:
    _shell_signals()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def start(args: list[str], log: Path, cwd: Path, preexec=_shell_signals) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        return subprocess.Popen(
            args, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=preexec
        )


def tree(pid: int) -> list[psutil.Process]:
    """``pid`` and every process below it now."""
    proc = psutil.Process(pid)
    return [proc, *proc.children(recursive=True)]


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running (a zombie, dead and waiting for its parent to reap it, is not)."""
    left = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(proc)
        except psutil.NoSuchProcess:
            pass
    return left


def wait_ended(procs: list[psutil.Process], timeout: float = DEADLINE) -> list[str]:
    """Wait up to ``timeout`` s for every process of ``procs`` to end; those left, described."""
    deadline = time.monotonic() + timeout
    while (left := alive(procs)) and time.monotonic() < deadline:
        time.sleep(0.1)
    described = []
    for proc in left:
        with contextlib.suppress(psutil.Error):
            described.append(f"{proc.pid}: {' '.join(proc.cmdline())[:200]}")
    return described


def port_free(port: int) -> bool:
    """Whether a new server can listen on ``port`` as a SuperLink does (SO_REUSEADDR, which
    lets it past connections in TIME_WAIT, but not past a socket still listening)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
        return True


def wait_for(condition, what: str, logs: list[Path], commands=(), timeout: float = STARTUP) -> None:
    """Until ``condition()``; fails, quoting the ``logs``, after ``timeout`` s or as soon as
    one of ``commands`` (processes that should be running) has ended."""
    deadline = time.monotonic() + timeout
    while not condition():
        ended = [" ".join(map(str, c.args)) for c in commands if c.poll() is not None]
        if ended or time.monotonic() > deadline:
            tails = "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.exists())
            why = f"{ended} ended" if ended else f"not within {timeout:g} s"
            raise AssertionError(f"{what}: {why}\n{tails}")
        time.sleep(0.2)


def cmdlines(pid: int) -> str:
    """The command lines of ``pid``'s tree, one string (empty once it is gone)."""
    text = []
    with contextlib.suppress(psutil.Error):
        for proc in alive(tree(pid)):
            with contextlib.suppress(psutil.Error):
                text.append(" ".join(proc.cmdline()))
    return "\n".join(text)


# ---------------------------------------------------------------- a stand-in command
#: A command with the process tree of a fedpeft command (every process records its pid):
#: ``command`` starts ``link`` (a SuperLink) under fedpeft's CommandProcesses; ``link``
#: starts ``exec`` in a session of its own (Flower's SuperExec) and ``message``, which
#: starts ``worker`` in a session of its own and exits (a ClientApp leaving a node's
#: worker, an orphan outside the command's tree).
STAND_IN = """
import os, subprocess, sys, time
from pathlib import Path

role, pids = sys.argv[1], Path(sys.argv[2])


def start(child, **kw):
    return subprocess.Popen([sys.executable, __file__, child, str(pids)], **kw)


if role == "command":
    from fedpeft.flower.processes import CommandProcesses, Stopped, popen

    try:
        with CommandProcesses():
            popen([sys.executable, __file__, "link", str(pids)])
            (pids / f"command-{os.getpid()}").touch()
            time.sleep(600)
    except Stopped as stop:
        print("stopped by", stop.name, flush=True)
        sys.exit(stop.exit_code)
    sys.exit(0)
if role == "link":
    start("exec", start_new_session=True)
    start("message")
if role == "message":
    start("worker", start_new_session=True)
    sys.exit(0)
(pids / f"{role}-{os.getpid()}").touch()
time.sleep(600)
"""
SLEEPERS = {"command", "link", "exec", "worker"}  # the processes of the stand-in that stay


def start_stand_in(tmp_path: Path, shell: bool = False, preexec=_shell_signals):
    """The stand-in command (``shell``: run by a bash that waits for it); once its whole
    tree is up: that process, every process of the tree (collected with psutil, and the
    orphaned worker) and the pid of each role."""
    script, pids = tmp_path / "stand_in.py", tmp_path / "pids"
    script.write_text(STAND_IN)
    pids.mkdir()
    args = [sys.executable, str(script), "command", str(pids)]
    if shell:  # `cmd; true`: bash forks the command and waits, as an interactive shell does
        args = ["bash", "-c", '"$@"; true', "bash", *args]
    proc = start(args, tmp_path / "out.log", tmp_path, preexec)
    up = lambda: {p.name.split("-")[0] for p in pids.iterdir()} >= SLEEPERS  # noqa: E731
    wait_for(up, "the stand-in's processes", [tmp_path / "out.log"], [proc], timeout=60)
    roles = {role: int(pid) for role, pid in (p.name.split("-") for p in pids.iterdir())}
    collected = {p.pid: p for p in alive(tree(proc.pid))}  # not the message, exited
    assert roles["worker"] not in collected  # it left the command's tree, as a node's worker does
    collected[roles["worker"]] = psutil.Process(roles["worker"])
    assert len(collected) == len(SLEEPERS) + shell
    return proc, list(collected.values()), roles


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_a_stop_signal_ends_every_process_the_command_started(tmp_path, signum):
    proc, procs, _ = start_stand_in(tmp_path)
    proc.send_signal(signum)
    assert wait_ended(procs) == []
    assert proc.wait(DEADLINE) == 128 + signum
    assert f"stopped by {signum.name}" in (tmp_path / "out.log").read_text()


def test_the_command_ends_with_its_shell(tmp_path):
    """The shell it runs in is killed (SIGKILL: it tells nobody): the command hears of it
    from the kernel (its parent-death signal, SIGHUP) and ends what it started."""
    shell, procs, _ = start_stand_in(tmp_path, shell=True)
    shell.kill()
    shell.wait()
    assert wait_ended(procs) == []
    assert "stopped by SIGHUP" in (tmp_path / "out.log").read_text()


def test_under_nohup_sighup_is_left_ignored(tmp_path):
    """Started with SIGHUP ignored (nohup), the command outlives a hangup; SIGTERM stops it."""
    proc, procs, _ = start_stand_in(tmp_path, preexec=_nohup_signals)
    proc.send_signal(signal.SIGHUP)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(2)
    assert len(alive(procs)) == len(procs)
    proc.terminate()
    assert wait_ended(procs) == []
    assert proc.wait(DEADLINE) == 128 + signal.SIGTERM


def test_a_stop_held_by_deferred_stop_takes_effect_at_its_end():
    """A step that must not be cut in the middle (serve submitting a run, whose id it
    needs to stop it) runs to its end; the stop comes right after."""
    script = """
import os, signal
from fedpeft.flower.processes import CommandProcesses, Stopped, deferred_stop

steps = []
try:
    with CommandProcesses():
        with deferred_stop():
            os.kill(os.getpid(), signal.SIGTERM)
            steps.append("the step's end")
        steps.append("after the step")
except Stopped as stop:
    print(steps, stop.name)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == '["the step\'s end"] SIGTERM', done.stdout + done.stderr


# ---------------------------------------------------------------- real deployments
@pytest.fixture
def deployment(tmp_path, tiny_config):
    """A folder with certificates, node keys and ``exp.yaml``: ``make(**overrides)``."""
    work = tmp_path / "work"
    make_certificates(work / "certs", ["127.0.0.1", "localhost"])
    make_node_keys(work / "certs" / "nodes", range(3))

    def make(**overrides):
        cfg = tiny_config(**{"partition.num_clients": 3, "train.threads": 1, **overrides})
        (work / "exp.yaml").write_text(dump_config(cfg))
        return work, cfg

    return make


TLS = ["--ca", "certs/ca.crt", "--cert", "certs/server.pem", "--key", "certs/server.key"]


def serve_args(port: int, *extra: str) -> list[str]:
    return [FEDPEFT, "serve", "exp.yaml", *TLS, "--enrolled", "certs/nodes", "--host", "127.0.0.1",
            "--port", str(port), *extra]  # fmt: skip


def join_args(port: int, cid: int) -> list[str]:
    return [FEDPEFT, "join", "--superlink", f"127.0.0.1:{port}", "--ca", "certs/ca.crt",
            "--key", f"certs/nodes/node-{cid}.key", "--partition-id", str(cid),
            "--state-dir", f"node{cid}", "--max-wait", "120"]  # fmt: skip


def worker_pid(work: Path, cid: int) -> int | None:
    status = work / f"node{cid}" / f"worker-{cid}.json"
    try:
        return int(json.loads(status.read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def stop_and_check(
    signum: int, commands: dict[str, subprocess.Popen], extra: list[psutil.Process], port: int
):
    """Send ``signum`` to every command; within the deadline nothing of theirs is left, the
    port is free. The commands' exit codes."""
    procs = list({p.pid: p for p in [*(p for c in commands.values() for p in tree(c.pid)), *extra]}.values())
    for proc in commands.values():
        proc.send_signal(signum)
    left = wait_ended(procs)
    assert left == [], f"still running {DEADLINE:g} s after {signum.name}:\n" + "\n".join(left)
    assert port_free(port), f"port {port} still taken after {signum.name}"
    return {name: proc.wait(DEADLINE) for name, proc in commands.items()}


@pytest.mark.deploy
@pytest.mark.xdist_group("flower_stop")
def test_serve_waiting_for_its_nodes_leaves_nothing(deployment, tmp_path):
    """The report's case: `fedpeft serve` with TLS, its ServerApp waiting for the nodes of
    a 50-round run, gets SIGTERM."""
    work, _ = deployment(**{"train.clients_per_round": 3, "train.rounds": 50})
    port = deploy.free_port()
    log = tmp_path / "serve.log"
    serve = start(serve_args(port), log, work)
    wait_for(lambda: "flwr-serverapp" in cmdlines(serve.pid), "the ServerApp started", [log], [serve])
    codes = stop_and_check(signal.SIGTERM, {"serve": serve}, [], port)
    said = log.read_text(errors="replace")
    assert codes["serve"] == 128 + signal.SIGTERM, said
    assert "stopped by SIGTERM" in said and "--resume continues it" in " ".join(said.split())


def serve_and_join_mid_run(deployment, tmp_path):
    """`fedpeft serve` (TLS, its own SuperLink, enrolled nodes) and one `fedpeft join`, once
    the node's worker trains: a long run (50 rounds) in its middle, with every kind of
    process up. The port, the two commands, their logs and the node's worker (which is
    outside the join's tree)."""
    work, _ = deployment(**{"train.clients_per_round": 1, "train.rounds": 50, "eval.every": 50})
    port = deploy.free_port()
    logs = {"serve": tmp_path / "serve.log", "join": tmp_path / "join.log"}
    commands = {"serve": start(serve_args(port), logs["serve"], work),
                "join": start(join_args(port, 0), logs["join"], work)}  # fmt: skip
    wait_for(
        lambda: (
            "flwr-serverapp" in cmdlines(commands["serve"].pid)
            and "fedpeft.flower.superexec" in cmdlines(commands["join"].pid)
            and worker_pid(work, 0) is not None
        ),
        "the run under way",
        list(logs.values()),
        commands.values(),
    )
    return port, commands, logs, psutil.Process(worker_pid(work, 0))


@pytest.mark.slow  # a minute each on 2 cores
@pytest.mark.deploy
@pytest.mark.xdist_group("flower_stop")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_serve_and_join_stopped_mid_run_leave_nothing(deployment, tmp_path, signum):
    port, commands, logs, worker = serve_and_join_mid_run(deployment, tmp_path)
    codes = stop_and_check(signum, commands, [worker], port)
    said = {name: log.read_text(errors="replace") for name, log in logs.items()}
    assert codes["serve"] == 128 + signum, said["serve"]
    assert f"stopped by {signum.name}" in said["serve"], said["serve"]
    assert codes["join"] == 0 and f"client 0: stopped ({signum.name})" in said["join"], said["join"]


@pytest.mark.slow
@pytest.mark.deploy
@pytest.mark.xdist_group("flower_stop")
def test_serve_and_join_killed_mid_run_leave_nothing(deployment, tmp_path):
    """SIGKILL, which no command can catch: the SuperLink and the SuperNode they started get
    SIGTERM from the kernel (their parent-death signal) and stop theirs (Flower's SuperExec
    and app processes watch their parent; a node's worker watches its node)."""
    port, commands, _, worker = serve_and_join_mid_run(deployment, tmp_path)
    codes = stop_and_check(signal.SIGKILL, commands, [worker], port)
    assert codes == {"serve": -signal.SIGKILL, "join": -signal.SIGKILL}


@pytest.mark.deploy
@pytest.mark.xdist_group("flower_stop")
def test_superlink_and_join_end_with_their_shells(deployment, tmp_path):
    """`fedpeft superlink` and `fedpeft join` each run by a bash that is then SIGKILLed."""
    work, _ = deployment()
    port = deploy.free_port()
    superlink = [FEDPEFT, "superlink", *TLS, "--enrolled", "certs/nodes", "--host", "127.0.0.1",
                 "--port", str(port), "--workdir", "superlink"]  # fmt: skip
    logs = {"superlink": tmp_path / "superlink.log", "join": tmp_path / "join.log"}
    shells = {name: start(["bash", "-c", '"$@"; true', "bash", *args], logs[name], work)
              for name, args in (("superlink", superlink), ("join", join_args(port, 0)))}  # fmt: skip
    try:
        wait_for(
            lambda: (
                "fedpeft.flower.superexec" in cmdlines(shells["join"].pid)
                and "SuperNode ID" in logs["join"].read_text(errors="replace")
            ),
            "the node joined",
            list(logs.values()),
            shells.values(),
        )
        procs = [p for shell in shells.values() for p in tree(shell.pid)]
        assert sum("flower-superexec" in " ".join(p.cmdline()) for p in procs) == 1  # the SuperLink's
        for shell in shells.values():
            shell.kill()
            shell.wait()
        left = wait_ended(procs)
        assert left == [], "still running once their shells died:\n" + "\n".join(left)
        assert port_free(port)
    finally:
        for proc in shells.values():
            deploy.stop(proc)
    assert "client 0: stopped (SIGHUP)" in logs["join"].read_text()
    assert "SuperLink stopped" in logs["superlink"].read_text()


@pytest.mark.slow
@pytest.mark.deploy
@pytest.mark.xdist_group("flower_stop")
def test_serve_to_a_long_lived_superlink_stops_its_run_there(deployment, tmp_path):
    """`fedpeft serve --superlink`, stopped, stops the run it submitted (`flwr stop`): its
    ServerApp, a process of the SuperLink's, ends; the SuperLink stays up for the next
    run, until it is stopped in turn."""
    work, _ = deployment(**{"train.clients_per_round": 3, "train.rounds": 50})
    port = deploy.free_port()
    logs = {"superlink": tmp_path / "superlink.log", "serve": tmp_path / "serve.log"}
    superlink = start([FEDPEFT, "superlink", *TLS, "--enrolled", "certs/nodes", "--host", "127.0.0.1",
                       "--port", str(port), "--workdir", "superlink"], logs["superlink"], work)  # fmt: skip
    serve = start([FEDPEFT, "serve", "exp.yaml", "--superlink", f"127.0.0.1:{port}", "--ca", "certs/ca.crt"],
                  logs["serve"], work)  # fmt: skip
    started = lambda: "flwr-serverapp" in cmdlines(superlink.pid)  # noqa: E731
    wait_for(started, "the ServerApp started", list(logs.values()), [superlink, serve])
    run = [p for p in alive(tree(superlink.pid)) if "flwr-serverapp" in " ".join(p.cmdline())]
    serve.terminate()
    left = wait_ended(tree(serve.pid))
    assert left == [], "still running after serve's SIGTERM:\n" + "\n".join(left)
    # the ServerApp is the SuperLink's: it ends when it next asks the SuperLink and hears
    # that its run was stopped (on a loaded machine, past the 15 s that serve's own have)
    left = wait_ended(run, timeout=RUN_STOPPED)
    assert left == [], f"the ServerApp still running {RUN_STOPPED:g} s after its run was stopped:\n" + (
        "\n".join(left)
    )
    assert serve.wait(DEADLINE) == 128 + signal.SIGTERM
    assert superlink.poll() is None and not port_free(port)  # the long-lived SuperLink stays

    procs = tree(superlink.pid)
    superlink.terminate()
    left = wait_ended(procs)
    assert left == [], "still running after the SuperLink's SIGTERM:\n" + "\n".join(left)
    assert port_free(port) and superlink.wait(DEADLINE) == 0
    assert "SuperLink stopped" in logs["superlink"].read_text()


@pytest.mark.slow  # two deployments, an in-process run: a few minutes on 2 cores
@pytest.mark.deploy
@pytest.mark.xdist_group("flower_stop")
def test_a_stopped_run_resumes_to_the_uninterrupted_metrics(deployment, tmp_path):
    """`fedpeft serve` (TLS) and three `fedpeft join` are sent SIGTERM after the first
    round: nothing is left, the port is free; the same commands again, serve with
    --resume, complete the run on that port with the metrics of an uninterrupted run of
    the same config (in-process, which a deployment equals: tests/flower/test_deploy.py)."""
    from fedpeft.experiment import run

    rounds = 8  # the stop comes after round 1: rounds enough that it lands in the middle
    work, cfg = deployment(**{"train.clients_per_round": 3, "train.rounds": rounds, "eval.every": 4,
                              "output_dir": str(tmp_path / "deployed")})  # fmt: skip
    metrics = Path(cfg.output_dir) / "metrics.jsonl"
    port = deploy.free_port()

    def start_all(tag: str, *extra: str) -> tuple[dict[str, subprocess.Popen], dict[str, Path]]:
        logs = {name: tmp_path / f"{tag}-{name}.log" for name in ("serve", "join0", "join1", "join2")}
        commands = {"serve": start(serve_args(port, *extra), logs["serve"], work)}
        # as the deployment guide has it: the nodes join once serve has enrolled their keys
        # and says how to join (a node that comes earlier is refused, and retries)
        hint = lambda: "clients join with" in logs["serve"].read_text(errors="replace")  # noqa: E731
        wait_for(hint, "serve's join hint", [logs["serve"]], [commands["serve"]])
        commands |= {f"join{i}": start(join_args(port, i), logs[f"join{i}"], work) for i in range(3)}
        return commands, logs

    commands, logs = start_all("first")
    try:
        rounds_done = lambda: metrics.is_file() and metrics.read_text().count("\n") >= 1  # noqa: E731
        wait_for(rounds_done, "round 1", list(logs.values()), commands.values())
        workers = [psutil.Process(pid) for cid in range(3) if (pid := worker_pid(work, cid)) is not None]
        assert len(workers) == 3  # every node trained round 1
        codes = stop_and_check(signal.SIGTERM, commands, workers, port)
    finally:
        for proc in commands.values():
            deploy.stop(proc)
    done = len(read_records(cfg.output_dir))
    assert codes["serve"] == 128 + signal.SIGTERM and 1 <= done < rounds, (codes, done)

    commands, logs = start_all("again", "--resume")
    try:
        code = commands["serve"].wait(STARTUP)
        assert code == 0, "\n".join(p.read_text(errors="replace")[-3000:] for p in logs.values())
    finally:
        for proc in commands.values():
            deploy.stop(proc)
    assert "finished:completed" in logs["serve"].read_text()
    deployed = read_records(cfg.output_dir)
    assert [r["round"] for r in deployed] == list(range(1, rounds + 1))

    uninterrupted = cfg.model_copy(update={"output_dir": tmp_path / "uninterrupted"})
    run(uninterrupted)
    reference = read_records(uninterrupted.output_dir)
    assert [r["clients"] for r in deployed] == [r["clients"] for r in reference]
    for a, b in zip(reference, deployed, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
    for key in ("global", "local"):
        assert deployed[-1][key] == pytest.approx(reference[-1][key], rel=1e-6)
