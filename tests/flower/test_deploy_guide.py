"""docs/deployment.md, followed as a new user would: real processes, real TLS.

- The guide's one-machine TLS walk-through is read from the page (the fenced block after
  the ``<!-- walkthrough: one-machine-tls`` comment) and run as written in a fresh copy of
  the repository (the files ``git`` would give a clone of this working tree), each
  command through the shell with the venv's ``fedpeft`` first on PATH (what ``source
  .venv/bin/activate`` does). ``fedpeft superlink`` and ``fedpeft join`` run until
  stopped, as the page says, so they run in the background; every other command runs to
  its end and must succeed. The one change: if the page's port 9092 is taken on this
  machine, another free port stands in for it. The deployed run must end with the same
  metrics as the simulated one.
- ``fedpeft serve`` with relative ``--ca/--cert/--key`` starting its own SuperLink, twice
  on one port, with ``fedpeft join`` nodes that outlive the first run's SuperLink.

Minutes of processes on 2 cores, so not in the default suite: marker ``guide`` (run by
``.ci/run``: ``bash scripts/test.sh -q -m guide``).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fedpeft.config import dump_config
from fedpeft.flower import deploy
from fedpeft.flower.certs import make_certificates, make_node_keys
from fedpeft.report.results import read_records, read_summary

pytestmark = [pytest.mark.deploy, pytest.mark.guide, pytest.mark.xdist_group("deploy_guide")]

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- walkthrough: one-machine-tls"
ENROLMENT = "<!-- walkthrough: enrol-revoke"
LONG_LIVED = ("fedpeft superlink", "fedpeft join")  # "keep running until Ctrl-C"


def walkthrough(page: str, marker: str = MARKER) -> list[str]:
    """The commands of the fenced block after ``marker``, continuation lines joined."""
    after = page.split(marker, 1)[1]
    block = re.search(r"```bash\n(.*?)```", after, flags=re.S)
    assert block, f"docs/deployment.md: no ```bash block after {marker}"
    text = block.group(1).replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def fresh_copy(dst: Path) -> Path:
    """The repository as a clone of this working tree has it: tracked and untracked files
    that git does not ignore (no runs/, no .venv/)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout of the repository")
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)
    return dst


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def shell_env() -> dict[str, str]:
    """The user's shell after ``source .venv/bin/activate``."""
    bindir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1"}


class Terminals:
    """Background commands (one terminal each), stopped with everything they started."""

    def __init__(self, cwd: Path, env: dict[str, str]):
        self.cwd, self.env, self.procs = cwd, env, []

    def start(self, command: str, log: Path) -> subprocess.Popen:
        out = open(log, "wb")  # noqa: SIM115 - the child's
        proc = subprocess.Popen(
            command, shell=True, cwd=self.cwd, env=self.env, stdout=out, stderr=subprocess.STDOUT
        )
        self.procs.append((proc, log))
        return proc

    def run(self, command: str, timeout: float) -> subprocess.CompletedProcess:
        done = subprocess.run(command, shell=True, cwd=self.cwd, env=self.env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
        if done.returncode != 0:
            raise AssertionError(f"`{command}` failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                                 f"{done.stderr[-3000:]}\n{self.logs()}")  # fmt: skip
        return done

    def logs(self) -> str:
        return "\n".join(
            f"--- {log.name}:\n{log.read_text(errors='replace')[-2000:]}" for _, log in self.procs
        )

    def stop(self) -> None:
        for proc, _ in self.procs:
            deploy.stop(proc)


def compare_runs(deployed: Path, simulated: Path) -> None:
    a, b = read_records(simulated), read_records(deployed)
    assert len(b) == len(a) and [r["clients"] for r in b] == [r["clients"] for r in a]
    assert all("dropped" not in r for r in b)
    for ra, rb in zip(a, b, strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-6)
        assert rb["payload_bytes_up"] == ra["bytes_up"]
    for key in ("global", "local"):
        assert b[-1][key] == pytest.approx(a[-1][key], rel=1e-6)
    assert read_summary(deployed)["engine"] == "flower"
    assert read_summary(simulated).get("engine") != "flower"


def wait_for(condition, timeout: float, what: str, shell: Terminals) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout:g} s\n{shell.logs()}"
        time.sleep(1)


def test_one_machine_tls_walkthrough(tmp_path):
    """Then the enrolment block: a fourth node enrolled joins; revoked, its `fedpeft join`
    stops with the one line and a non-zero exit while the others stay up."""
    page = (ROOT / "docs" / "deployment.md").read_text()
    commands, enrolment = walkthrough(page), walkthrough(page, ENROLMENT)
    clone = fresh_copy(tmp_path / "fedpeft")
    if not port_free(9092):  # taken on this machine: the only change to the page's commands
        port = str(deploy.free_port())
        commands = [c.replace("9092", port) for c in commands]
        enrolment = [c.replace("9092", port) for c in enrolment]
    shell = Terminals(clone, shell_env())
    background = []
    try:
        for i, command in enumerate(commands):
            if command.startswith(LONG_LIVED):
                background.append(shell.start(command, tmp_path / f"terminal-{i}.log"))
            else:
                shell.run(command, timeout=900)
        # the nodes outlive the run: still up for the next one
        assert background and all(p.poll() is None for p in background), shell.logs()
        late, late_log = None, tmp_path / "terminal-late.log"
        for command in enrolment:
            if command.startswith("fedpeft join"):
                late = shell.start(command, late_log)
                continue
            if command.startswith("fedpeft revoke"):  # once the late node is in
                wait_for(
                    lambda: "SuperNode ID" in late_log.read_text(), 180, "the enrolled node joined", shell
                )
            shell.run(command, timeout=300)
        assert late is not None
        wait_for(lambda: late.poll() is not None, 300, "the revoked node stopped", shell)
        said = late_log.read_text()
        assert late.returncode != 0 and "refused this node" in " ".join(said.split()), shell.logs()
        assert all(p.poll() is None for p in background), shell.logs()  # the others stay
    finally:
        shell.stop()
    assert any(c.startswith("fedpeft serve") and "--ca runs/certs/ca.crt" in c for c in commands)
    config = yaml.safe_load((clone / "examples" / "my.yaml").read_text())
    deployed, simulated = clone / config["output_dir"], clone / "runs" / "my-simulated"
    compare_runs(deployed, simulated)


def test_serve_with_relative_certificates_and_nodes_that_outlive_runs(tiny_config, tmp_path):
    """`fedpeft serve` with relative --ca/--cert/--key, starting (and stopping) its own
    SuperLink; the same three `fedpeft join` nodes then take part in a second `serve` on
    the same port: they rejoin its new SuperLink by themselves."""
    work = tmp_path / "work"
    make_certificates(work / "certs", ["127.0.0.1", "localhost"])
    make_node_keys(work / "certs" / "nodes", range(3))
    cfg = tiny_config(**{"partition.num_clients": 3, "train.clients_per_round": 3, "train.threads": 1,
                         "train.rounds": 1, "eval.every": 1, "output_dir": "runs/first"})  # fmt: skip
    (work / "exp.yaml").write_text(dump_config(cfg))
    port = deploy.free_port()
    tls = "--ca certs/ca.crt --cert certs/server.pem --key certs/server.key"
    serve = f"fedpeft serve exp.yaml {tls} --enrolled certs/nodes --host 127.0.0.1 --port {port}"
    shell = Terminals(work, shell_env())
    try:
        join = f"fedpeft join --superlink 127.0.0.1:{port} --ca certs/ca.crt --max-wait 300"
        nodes = [shell.start(f"{join} --key certs/nodes/node-{i}.key --partition-id {i} --state-dir node{i}",
                             tmp_path / f"join{i}.log") for i in range(3)]  # fmt: skip
        first = shell.run(serve, timeout=600)
        assert "clients join with: fedpeft join --superlink 127.0.0.1:" in first.stdout
        assert "--ca certs/ca.crt" in first.stdout  # the hint says how to connect
        second = shell.run(f"{serve} --set output_dir=runs/second", timeout=600)
        assert "finished:completed" in second.stdout
        assert all(p.poll() is None for p in nodes), shell.logs()
        joined = [(tmp_path / f"join{i}.log").read_text() for i in range(3)]
    finally:
        shell.stop()
    for name in ("first", "second"):
        records = read_records(work / "runs" / name)
        assert [r["round"] for r in records] == [1]
        assert records[0]["clients_returned"] == [0, 1, 2]
    for text in joined:
        assert "no longer knows this node" in " ".join(text.split())  # and it rejoined
        assert "Traceback" not in text and "Connection attempt failed" not in text


def test_a_real_superlink_is_diagnosed_as_the_stand_ins_are(tmp_path):
    """tests/flower/test_connect.py checks the diagnosis against stand-in servers; here the
    same causes against Flower's own SuperLink, with and without TLS."""
    from fedpeft.flower.connect import probe

    good = make_certificates(tmp_path / "good", ["127.0.0.1"])
    other = make_certificates(tmp_path / "other", ["127.0.0.1"])
    tls = deploy.Tls(good["ca.crt"], good["server.pem"], good["server.key"])
    plain_port, tls_port = deploy.free_port(), deploy.free_port()
    links = [deploy.start_superlink(tmp_path / "plain", "127.0.0.1", plain_port, None),
             deploy.start_superlink(tmp_path / "tls", "127.0.0.1", tls_port, tls)]  # fmt: skip
    try:
        plain, secure = f"127.0.0.1:{plain_port}", f"127.0.0.1:{tls_port}"
        assert probe(plain, None) is None and probe(secure, deploy.Tls(good["ca.crt"])) is None
        assert "speaks TLS but --insecure" in probe(secure, None).why
        assert "answers without TLS" in probe(plain, deploy.Tls(good["ca.crt"])).why
        assert "does not verify against --ca" in probe(secure, deploy.Tls(other["ca.crt"])).why
        assert (
            "not valid for the name 'localhost'"
            in probe(f"localhost:{tls_port}", deploy.Tls(good["ca.crt"])).why
        )
    finally:
        for link in links:
            deploy.stop(link)
