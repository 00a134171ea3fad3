"""Start the pieces of a Flower deployment and run a fedpeft experiment on them.

``fedpeft serve`` and ``fedpeft join`` are thin wrappers over this module:

- :func:`start_superlink` runs Flower's SuperLink (one HTTP(S) server: Fleet API for
  the SuperNodes, Control API for ``flwr run``, Runtime API for the ServerApp) behind
  fedpeft's gate (:mod:`fedpeft.flower.superlink`: the Control API for the operator alone);
- :func:`start_supernode` runs Flower's SuperNode for one client
  (:mod:`fedpeft.flower.supernode`: it runs only runs its operator signed), with its
  ``partition-id``, optional ``data-file`` and ``state-dir`` as node config;
- :func:`submit` writes a Flower app directory whose components are fedpeft's
  ``server_app``/``client_app`` and whose run config is the experiment, submits it with
  ``flwr run`` and follows it to the end.

Every process gets its own ``FLWR_HOME`` and an environment that keeps Flower off the
network (no telemetry, no update check, no dependency installation at run time: the
package is already installed on every machine). Certificate paths are made absolute
(:class:`Tls`), as are the config's paths: these processes run in other folders. A
command ends every process it started when it stops, however it stops
(:mod:`fedpeft.flower.processes`); :func:`stop` ends one process and its tree.

``fedpeft superlink`` keeps one SuperLink up for run after run; ``fedpeft join`` checks
the SuperLink's address and keeps its node joined (:mod:`fedpeft.flower.connect`,
:mod:`fedpeft.flower.join`). What the operator tells a running SuperLink (runs, enrolment)
goes through :mod:`fedpeft.flower.control`.
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import tomli_w

from fedpeft.composition import refusal
from fedpeft.config import ConfigError, ExperimentConfig, dump_config
from fedpeft.flower import control, processes
from fedpeft.flower.connect import local_address, probe
from fedpeft.flower.control import CONNECTION, enrol, flwr, operator_of, revoke, run_status, write_connection
from fedpeft.flower.operator import Operator, sign_app
from fedpeft.flower.processes import flower_env  # noqa: F401 - a node's environment (fedpeft join)
from fedpeft.flower.tls import DeployError, Tls

_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port free now, never one this process handed out before (the kernel
    may offer a just-released port again, before whoever got it has bound it)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def _spawn(
    cmd: list[str], workdir: Path, home: Path, log: Path | None, env: dict[str, str] | None = None
) -> subprocess.Popen:
    workdir.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") if log else contextlib.nullcontext() as out:  # the child keeps its own copy
        return processes.popen(
            cmd, cwd=workdir, env=processes.flower_env(home, env), stdout=out, stderr=subprocess.STDOUT
        )


def start_superlink(
    workdir: Path,
    host: str,
    port: int,
    tls: Tls | None,
    log: Path | None = None,
    *,
    auth: bool | None = None,
    persistent: bool = True,
    remote_operator: bool = False,
) -> subprocess.Popen:
    """Flower's SuperLink on ``host:port``, behind fedpeft's gate
    (:mod:`fedpeft.flower.superlink`: the Control API answers the operator only, from this
    machine unless ``remote_operator``); returns once it answers its health check.
    ``auth`` (default: with TLS): SuperNode authentication, so that only nodes whose public
    key was registered (:func:`enrol`) can join; Flower allows it over TLS only. Its
    ServerApps learn it (``FEDPEFT_NODE_AUTH``), which key each enrolled node has
    (``FEDPEFT_NODE_KEYS``: ``workdir/nodes.json``) and the operator's client-id
    assignments (``FEDPEFT_CLIENT_ASSIGNMENTS``: ``workdir/clients.json``).
    ``persistent``: its state (runs, enrolled nodes) in ``workdir/superlink.db``, kept
    across its restarts; otherwise in memory, which answers the nodes' requests faster
    (a SuperLink that lives for one run or one federation needs nothing kept)."""

    auth = tls is not None if auth is None else auth
    if auth and tls is None:
        raise DeployError(
            "SuperNode authentication needs TLS (--ca, --cert, --key): Flower refuses it without"
        )
    if tls is None:
        security = ["--insecure"]
    else:
        if tls.cert is None or tls.key is None:
            raise DeployError("a TLS SuperLink needs its certificate and key (--cert, --key) besides --ca")
        tls.check()
        security = [
            "--ssl-ca-certfile",
            str(tls.ca),
            "--ssl-certfile",
            str(tls.cert),
            "--ssl-keyfile",
            str(tls.key),
        ]
    database = ["--database", str(workdir / "superlink.db")] if persistent else []  # none: in memory
    cmd = [sys.executable, "-m", "fedpeft.flower.superlink", *security, "--host", host, "--port", str(port),
           "--disable-runtime-dependency-installation", *database,
           *(["--enable-supernode-auth"] if auth else []),
           *(["--remote-operator"] if remote_operator else [])]  # fmt: skip
    env = {  # what the runs' ServerApps learn of it (fedpeft.flower.members.enrolment)
        "FEDPEFT_NODE_AUTH": "1" if auth else "0",
        "FEDPEFT_NODE_KEYS": str(control.node_keys(workdir)),
        "FEDPEFT_CLIENT_ASSIGNMENTS": str(control.assignments(workdir)),
    }
    proc = _spawn(cmd, workdir, workdir / "home-superlink", log, env)
    wait_healthy(proc, local_address(host, port, tls), tls, log)
    return proc


def wait_healthy(
    proc: subprocess.Popen, address: str, tls: Tls | None, log: Path | None, timeout: float = 120
) -> None:
    """Return once the SuperLink ``proc`` answers its health check at ``address``."""

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text()[-2000:] if log and log.exists() else ""
            raise DeployError(f"the SuperLink exited with code {proc.returncode}:\n{tail}")
        problem = probe(address, tls, timeout=2)
        if problem is None:
            return
        if problem.lasting:
            stop(proc)
            raise DeployError(f"the SuperLink just started at {address}: {problem.why}")
        time.sleep(0.3)
    raise DeployError(f"the SuperLink at {address} not healthy after {timeout:g} s")


def node_config(partition_id: int, state_dir: Path, data_file: Path | None = None) -> str:
    """The ``--node-config`` string (TOML values) that tells a node who it is."""
    items = {"partition-id": partition_id, "state-dir": str(state_dir.resolve())}
    if data_file is not None:
        items["data-file"] = str(data_file.resolve())
    return " ".join(f"{k}={json.dumps(v)}" for k, v in items.items())


def supernode_command(
    superlink: str,
    partition_id: int,
    state_dir: Path,
    *,
    data_file: Path | None,
    tls: Tls | None,
    port: int,
    key: Path | None = None,
) -> list[str]:
    """``key``: the node's private key, which it signs its requests with (an authenticating
    SuperLink admits it only once its public key is enrolled)."""
    security = ["--insecure"] if tls is None else ["--root-certificates", str(tls.ca)]
    signing = [] if key is None else ["--auth-supernode-private-key", str(Path(key).expanduser().resolve())]
    # Flower's SuperNode, polling the SuperLink every FEDPEFT_NODE_POLL s (not 3 s)
    supernode = [sys.executable, "-m", "fedpeft.flower.supernode"]
    return [*supernode, *security, *signing, "--superlink", superlink,
            "--host", "127.0.0.1", "--port", str(port),
            "--node-config", node_config(partition_id, state_dir, data_file)]  # fmt: skip


def start_supernode(
    workdir: Path,
    superlink: str,
    partition_id: int,
    *,
    state_dir: Path | None = None,
    data_file: Path | None = None,
    tls: Tls | None = None,
    port: int | None = None,
    log: Path | None = None,
    key: Path | None = None,
) -> subprocess.Popen:
    """``flower-supernode`` for client ``partition_id``, connecting to ``superlink``
    (signing with ``key``, its private key, when given)."""
    state_dir = state_dir or workdir / f"node-{partition_id}"
    cmd = supernode_command(
        superlink, partition_id, state_dir, data_file=data_file, tls=tls, port=port or free_port(), key=key
    )
    return _spawn(cmd, workdir, workdir / f"home-node-{partition_id}-{time.time_ns()}", log)


def stop(proc: subprocess.Popen, timeout: float = processes.GRACE) -> None:
    """Stop a process and everything it started (SuperExec, app processes): SIGTERM to all
    of them at once, SIGKILL to those still there after ``timeout`` seconds."""
    processes.end_tree(proc, timeout)


# ---------------------------------------------------------------- the run
def absolute_paths(cfg: ExperimentConfig) -> ExperimentConfig:
    """The config with every local path made absolute: the ServerApp and the nodes run
    in other working directories."""
    update: dict = {"output_dir": cfg.output_dir.resolve()}
    data = {"wordnet_dir": cfg.data.wordnet_dir.resolve()}
    if cfg.data.path is not None:
        data["path"] = cfg.data.path.resolve()
    update["data"] = cfg.data.model_copy(update=data)
    if Path(cfg.model.backbone).exists():
        update["model"] = cfg.model.model_copy(update={"backbone": str(Path(cfg.model.backbone).resolve())})
    return cfg.model_copy(update=update)


#: The ClientApp of a node: a relay to its warm worker, or fedpeft's client itself.
CLIENT_APPS = {True: "fedpeft.flower.relay:client_app", False: "fedpeft.flower.apps:client_app"}


def write_app(
    app_dir: Path,
    cfg: ExperimentConfig,
    resume: bool,
    operator: Operator | None = None,
    resume_from: int | None = None,
) -> Path:
    """A Flower app directory whose components are fedpeft's and whose run config is
    the experiment (and where it resumes from: the newest checkpoint, ``resume``, or round
    ``resume_from``'s). It holds no code: the components import from the installed package.
    With the ``operator``'s credential the run is signed: nodes given a CA run only apps
    that CA's operator signed (:func:`fedpeft.flower.operator.check_app`)."""
    app_dir.mkdir(parents=True, exist_ok=True)
    project = {
        "project": {"name": "fedpeft-app", "version": "1.0.0", "dependencies": []},
        "tool": {
            "flwr": {
                "app": {
                    "publisher": "fedpeft",
                    "components": {
                        "serverapp": "fedpeft.flower.apps:server_app",
                        "clientapp": CLIENT_APPS[cfg.deploy.warm_nodes],
                    },
                    "config": {
                        "experiment": dump_config(cfg),
                        "resume": resume,
                        **({"resume_from": resume_from} if resume_from is not None else {}),
                    },
                }
            }
        },
    }
    if operator is not None:
        project = sign_app(project, operator)
    (app_dir / "pyproject.toml").write_text(tomli_w.dumps(project))
    return app_dir


def check_deployable(cfg: ExperimentConfig) -> None:
    """A :class:`ConfigError` naming the key when ``cfg`` asks for what a deployed run
    cannot do (simulated faults; client drift): the deployment's rules of the config
    alone (:func:`fedpeft.composition.refusal`), before anything starts."""
    if why := refusal(cfg, engine="deployment"):
        raise ConfigError(why)


def submit(
    cfg: ExperimentConfig,
    superlink: str,
    *,
    workdir: Path,
    tls: Tls | None = None,
    resume: bool = False,
    resume_from: int | None = None,
    timeout: float | None = None,
    echo: bool = True,
    stop_if_interrupted: bool = True,
) -> dict:
    """Run ``cfg`` on the federation behind ``superlink`` (its Control API address) and
    wait for the end; returns Flower's final record of the run (status, traffic).
    Interrupted (Ctrl-C, a stop signal: :class:`~fedpeft.flower.processes.Stopped`), the
    run is stopped on the SuperLink (``flwr stop``) unless ``stop_if_interrupted`` is
    false (a SuperLink about to be stopped ends its runs itself); it continues from its
    last completed round with ``resume`` (from round ``resume_from``'s kept checkpoint with that)."""
    check_deployable(cfg)
    cfg = absolute_paths(cfg)
    home, follower = workdir / "home-cli", workdir / "home-log"
    write_connection(home, superlink, tls)
    app = write_app(workdir / "app", cfg, resume, operator_of(tls), resume_from)
    run_id, logs = None, None
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        with processes.deferred_stop():  # a run is stopped by its id: once submitted, it is known
            run_id = _run_id(flwr(home, "run", str(app), CONNECTION, "--format", "json"))
        # the run's log: echoed, or kept in the work directory (its tail explains a failure)
        log_file = workdir / f"run-{run_id}.log"
        said = lambda: "" if echo else f"; the run's log ({log_file}) ends:\n{_tail(log_file)}"  # noqa: E731
        # the follower, a long-lived flwr, signs in with a home of its own (each call on
        # ``home`` removes its token when it ends), signed out when the run is over
        write_connection(follower, superlink, tls)
        control.sign_in(follower)
        with contextlib.ExitStack() as files:
            sink = None if echo else files.enter_context(open(log_file, "wb"))
            logs = processes.popen(
                [processes.script("flwr"), "log", str(run_id), CONNECTION, "--stream"],
                env=flower_env(follower),
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        while not (status := run_status(home, run_id)).get("status", "").startswith("finished"):
            if deadline is not None and time.monotonic() > deadline:
                flwr(home, "stop", str(run_id), CONNECTION, check=False)
                raise DeployError(
                    f"run {run_id} still {status.get('status')} after {timeout:g} s; stopped{said()}"
                )
            time.sleep(1)
    except KeyboardInterrupt:
        if logs is not None:
            stop(logs)
        if stop_if_interrupted and run_id is not None:  # else its ServerApp goes on writing the output
            with contextlib.suppress(subprocess.TimeoutExpired):
                flwr(home, "stop", str(run_id), CONNECTION, check=False, timeout=30)
        raise
    finally:
        if logs is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                logs.wait(10)  # the stream ends with the run
            stop(logs)
        control.sign_out(follower)
    status["run-id"] = run_id
    if status["status"] != "finished:completed":
        raise DeployError(f"run {run_id} {status['status']}: {status.get('status-details', '')}{said()}")
    return status


def _run_id(reply: subprocess.CompletedProcess) -> int:
    """The run id in ``flwr run --format json``'s reply."""
    try:
        return int(json.loads(reply.stdout)["run-id"])
    except (json.JSONDecodeError, KeyError) as err:
        raise DeployError(f"flwr run gave no run id: {reply.stdout[-800:]} {reply.stderr[-800:]}") from err


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.is_file() else "(no log)"


@contextlib.contextmanager
def local_federation(
    workdir: Path,
    num_nodes: int,
    *,
    tls: Tls | None = None,
    node_dirs: list[Path] | None = None,
    auth: bool | None = None,
) -> Iterator[Federation]:
    """A SuperLink and ``num_nodes`` SuperNodes on loopback (client ids ``0..n-1``), torn
    down on exit. For tests, benchmarks and trying a deployment on one machine. With
    ``auth`` (default: with TLS) the SuperLink authenticates SuperNodes: each node gets a
    key pair (``workdir/keys``), enrolled before it starts."""
    from fedpeft.flower.certs import make_node_keys

    port = free_port()
    auth = tls is not None if auth is None else auth
    fed = Federation(workdir, f"127.0.0.1:{port}", tls)
    fed.superlink = start_superlink(
        workdir, "127.0.0.1", port, tls, log=workdir / "superlink.log", auth=auth, persistent=False
    )
    try:
        if auth:
            fed.keys = make_node_keys(workdir / "keys", range(num_nodes))
            for i in range(num_nodes):
                fed.enrol(i)
        for i in range(num_nodes):
            fed.start_node(i, state_dir=node_dirs[i] if node_dirs else None)
        yield fed
    finally:
        for proc in [*fed.nodes.values(), fed.superlink]:
            stop(proc)


@dataclass
class Federation:
    workdir: Path
    address: str
    tls: Tls | None
    superlink: subprocess.Popen | None = None

    def __post_init__(self) -> None:
        self.nodes: dict[int, subprocess.Popen] = {}
        self.keys: dict[int, tuple[Path, Path]] = {}  # client id -> its key pair (SuperNode auth)
        self.enrolled: dict[int, int] = {}  # client id -> the node id its key is registered as

    def start_node(self, cid: int, state_dir: Path | None = None, key: Path | None = None) -> None:
        """Client ``cid``'s SuperNode, signing with its own key (``key``: another one)."""
        self.nodes[cid] = start_supernode(
            self.workdir,
            self.address,
            cid,
            state_dir=state_dir,
            tls=self.tls,
            log=self.workdir / f"supernode-{cid}.log",
            key=key or (self.keys[cid][0] if cid in self.keys else None),
        )

    def enrol(self, cid: int) -> int:
        """Register client ``cid``'s public key with the SuperLink; its node id."""
        assert self.tls is not None
        self.enrolled[cid] = enrol(
            self.address, self.keys[cid][1], self.tls, self.workdir, name=f"client-{cid}"
        )
        return self.enrolled[cid]

    def revoke(self, cid: int) -> None:
        """Unregister client ``cid``'s node: refused from its next request on."""
        assert self.tls is not None
        revoke(self.address, self.enrolled.pop(cid), self.tls, self.workdir)

    def log_tails(self, chars: int = 1500) -> str:
        """The end of every log of this federation (SuperLink, SuperNodes, workers), for a
        run that failed or did not finish."""
        logs = [self.workdir / "superlink.log", *sorted(self.workdir.glob("supernode-*.log")),
                *sorted(self.workdir.glob("node-*/worker-*.log"))]  # fmt: skip
        return "\n".join(f"--- {log}\n{_tail(log, chars)}" for log in logs)

    def kill_node(self, cid: int) -> None:
        """SIGKILL a node and its app processes: a crash, not a shutdown."""
        proc = self.nodes.pop(cid)
        for child in [*processes.descendants(proc.pid), proc]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGKILL)
        proc.wait()
