"""Reaching a SuperLink, without starting one: what ``fedpeft join`` says about a wrong
address or a TLS mismatch, how long it waits, certificate paths made absolute, the
address ``serve`` uses for its own SuperLink, the node's output filter, and the guide's
example configs. Cheap (stand-in HTTP(S) servers, no Flower process); the real
deployments are in tests/flower/test_deploy.py and tests/flower/test_deploy_guide.py."""

from __future__ import annotations

import contextlib
import http.server
import io
import re
import shutil
import signal
import ssl
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedpeft.cli import app
from fedpeft.config import load_config
from fedpeft.flower.certs import make_certificates
from fedpeft.flower.connect import local_address, probe
from fedpeft.flower.deploy import Tls, free_port
from fedpeft.flower.join import Echo

ROOT = Path(__file__).resolve().parents[2]


class Health(http.server.BaseHTTPRequestHandler):
    """Answers ``GET /health`` as a SuperLink does; 404 for anything else."""

    def do_GET(self):  # noqa: N802 - the name http.server calls
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    work = tmp_path_factory.mktemp("certs")
    return make_certificates(work / "good", ["127.0.0.1"]), make_certificates(work / "other", ["127.0.0.1"])


@pytest.fixture(scope="module")
def servers(certs):
    """A plain-HTTP and a TLS stand-in SuperLink on loopback: their addresses."""
    good, _ = certs
    plain = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    secure = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(good["server.pem"], good["server.key"])
    secure.socket = context.wrap_socket(secure.socket, server_side=True)
    for server in (plain, secure):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{plain.server_port}", f"127.0.0.1:{secure.server_port}"
    for server in (plain, secure):
        server.shutdown()


def test_probe_names_the_cause(servers, certs):
    plain, secure = servers
    good, other = Tls(certs[0]["ca.crt"]), Tls(certs[1]["ca.crt"])
    assert probe(plain, None) is None
    assert probe(secure, good) is None

    tls_to_plain = probe(plain, good)
    assert tls_to_plain.lasting and "without TLS" in tls_to_plain.why and "--insecure" in tls_to_plain.why
    plain_to_tls = probe(secure, None)
    assert plain_to_tls.lasting and "speaks TLS but --insecure" in plain_to_tls.why
    wrong_ca = probe(secure, other)
    assert wrong_ca.lasting and "does not verify against --ca" in wrong_ca.why
    assert str(certs[1]["ca.crt"]) in wrong_ca.why
    port = secure.rpartition(":")[2]
    wrong_name = probe(f"localhost:{port}", good)  # the certificate lists 127.0.0.1 only
    assert wrong_name.lasting and "not valid for the name 'localhost'" in wrong_name.why

    closed = probe(f"127.0.0.1:{free_port()}", None)
    assert not closed.lasting and "connection refused" in closed.why


def test_probe_refuses_a_server_that_is_not_a_superlink():
    class NoHealth(Health):
        def do_GET(self):  # noqa: N802
            self.send_response(404)
            self.end_headers()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NoHealth)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        problem = probe(f"127.0.0.1:{server.server_port}", None)
    finally:
        server.shutdown()
    assert problem.lasting and "not a Flower SuperLink (HTTP 404" in problem.why


@pytest.fixture
def runner():
    """A CLI runner; ``join`` installs a SIGTERM handler, which must not outlive the test."""
    before = signal.getsignal(signal.SIGTERM)
    yield CliRunner()
    with contextlib.suppress(ValueError):  # only the main thread sets handlers (and join then did)
        signal.signal(signal.SIGTERM, before)


def test_join_gives_up_on_a_closed_port_within_its_bound(tmp_path, runner):
    """Nothing listens there: the node retries for --max-wait seconds, then exits with one
    line that names the address and the cause (and starts no SuperNode meanwhile)."""
    address = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    res = runner.invoke(app, ["join", "--superlink", address, "--insecure", "--partition-id", "0",
                              "--state-dir", str(tmp_path / "node"), "--max-wait", "3"])  # fmt: skip
    elapsed = time.monotonic() - t0
    out = " ".join(res.output.split())
    assert res.exit_code == 2, out
    assert 3 <= elapsed < 3 + 10  # it retried up to its bound, and not much longer
    assert f"error: no SuperLink at {address} after 3 s (--max-wait)" in out
    assert "nothing is listening there (connection refused)" in out
    assert f"waiting for the SuperLink at {address}" in out  # the cause is said at once, too
    assert not (tmp_path / "node" / "supernode.log").exists()


def test_join_stops_at_once_on_a_tls_mismatch(tmp_path, runner, servers, certs):
    plain, secure = servers
    t0 = time.monotonic()
    res = runner.invoke(app, ["join", "--superlink", secure, "--insecure", "--partition-id", "0",
                              "--state-dir", str(tmp_path / "n0")])  # fmt: skip
    out = " ".join(res.output.split())
    assert res.exit_code == 2 and time.monotonic() - t0 < 30  # not the default 300 s wait
    assert f"the SuperLink at {secure}: it speaks TLS but --insecure was given" in out
    res = runner.invoke(app, ["join", "--superlink", plain, "--ca", str(certs[0]["ca.crt"]),
                              "--partition-id", "0", "--state-dir", str(tmp_path / "n1")])  # fmt: skip
    out = " ".join(res.output.split())
    assert res.exit_code == 2 and f"the SuperLink at {plain}: it answers without TLS" in out


def test_certificate_paths_are_made_absolute(tmp_path, monkeypatch, certs):
    """Relative paths are resolved where they were given: Flower's processes run elsewhere."""
    shutil.copytree(Path(certs[0]["ca.crt"]).parent, tmp_path / "certs")
    monkeypatch.chdir(tmp_path)
    tls = Tls(Path("certs/ca.crt"), Path("certs/server.pem"), Path("certs/server.key"))
    monkeypatch.chdir("/")
    for path in (tls.ca, tls.cert, tls.key):
        assert path.is_absolute() and path.is_file()
    with pytest.raises(Exception, match=r"--key .*/certs/missing.key: no such file"):
        Tls(tls.ca, tls.cert, tmp_path / "certs" / "missing.key").check()


def test_serve_reaches_its_own_superlink_by_a_name_the_certificate_lists(tmp_path):
    loopback = make_certificates(tmp_path / "a", ["127.0.0.1", "localhost"])
    remote = make_certificates(tmp_path / "b", ["fl.example.org", "10.0.0.5"])
    assert local_address("0.0.0.0", 9092, None) == "127.0.0.1:9092"
    assert local_address("0.0.0.0", 9092, Tls(loopback["ca.crt"], loopback["server.pem"])) == "127.0.0.1:9092"
    # the certificate lists no loopback name: its first IP address (which is this machine's)
    assert local_address("0.0.0.0", 9092, Tls(remote["ca.crt"], remote["server.pem"])) == "10.0.0.5:9092"
    assert local_address("10.0.0.5", 9092, None) == "10.0.0.5:9092"


def test_serve_hint_and_tls_flags(tmp_path, runner):
    res = runner.invoke(app, ["serve", "--insecure", "--cert", str(tmp_path / "x.pem")])
    assert res.exit_code == 2 and "--cert" in res.output and "--insecure" in res.output
    res = runner.invoke(app, ["serve", "--superlink", "127.0.0.1:1", "--ca", "ca.crt", "--cert", "s.pem"])
    assert res.exit_code == 2 and "with --superlink give --ca only" in " ".join(res.output.split())


#: What flower-supernode 1.41 prints when a restarted SuperLink does not know it (abridged).
FORGOTTEN_LOG = """\
\x1b[92mINFO \x1b[0m:      SuperNode ID: 15354058742510829958
\x1b[93mWARNING \x1b[0m:   Connection attempt failed, retrying in 0.43 seconds
Exception in thread Thread-2 (_run):
Traceback (most recent call last):
  File "/x/threading.py", line 1045, in _bootstrap_inner
    self.run()
  File "/x/flwr/supercore/protobuf/client.py", line 188, in send
    http_response.raise_for_status()
httpx.HTTPStatusError: Client error '401 Unauthorized' for url 'http://127.0.0.1:39192/v1/fleet/send-node-heartbeat'
For more information check: https://developer.mozilla.org/en-US/docs/Web/HTTP/Status/401
\x1b[92mINFO \x1b[0m:      SuperNode terminated gracefully.
"""


#: The same while the node was pulling messages: another thread's log record lands inside
#: the traceback, and Flower's own shutdown adds a chained one (abridged).
FORGOTTEN_WHILE_PULLING = """\
INFO:     Finished server process [23543]
Traceback (most recent call last):
\x1b[93mWARNING \x1b[0m:   Connection attempt failed, retrying in 0.63 seconds
  File "/x/flwr/supercore/retry/retry_invoker.py", line 266, in invoke
    ret = target(*args, **kwargs)
          ^^^^^^^^^^^^^^^^^^^^^^^
httpx.HTTPStatusError: Client error '401 Unauthorized' for url 'https://127.0.0.1:36605/v1/fleet/pull-messages'
For more information check: https://developer.mozilla.org/en-US/docs/Web/HTTP/Status/401

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/x/bin/flower-supernode", line 8, in <module>
    sys.exit(flower_supernode())
  File "/x/threading.py", line 1139, in _wait_for_tstate_lock
    if lock.acquire(block, timeout):
       ^^^^^^^^^^^^^^^^^^^^^^^^^^^^
KeyboardInterrupt
\x1b[92mINFO \x1b[0m:      SuperExec terminated gracefully.
"""


#: The heartbeat thread's traceback written in pieces (indentation, then the source line)
#: while the main thread logs: a line of the traceback is split, and its unindented second
#: half must not end it (seen in CI; abridged).
FORGOTTEN_SPLIT_LINES = """\
INFO:     Finished server process [736]
Exception in thread Thread-2 (_run):
Traceback (most recent call last):
  File "/x/threading.py", line 1045, in _bootstrap_inner
    self.run()
  File "/x/flwr/supernode/fleet_http_client.py", line 98, in SendNodeHeartbeat
    \x1b[92mINFO \x1b[0m:      SuperNode terminated gracefully.
return self._unary_unary(
           ^^^^^^^^^^^^^^^^^^
  File "/x/flwr/supercore/protobuf/client.py", line 194, in _unary_unary
    else send()
         ^^^^^^
httpx.HTTPStatusError: Client error '401 Unauthorized' for url 'https://127.0.0.1:34577/v1/fleet/send-node-heartbeat'
For more information check: https://developer.mozilla.org/en-US/docs/Web/HTTP/Status/401
INFO:     Shutting down
"""


@pytest.mark.parametrize(
    "text",
    [FORGOTTEN_LOG, FORGOTTEN_WHILE_PULLING, FORGOTTEN_SPLIT_LINES],
    ids=["heartbeat", "pulling", "split"],
)
def test_node_output_filter(text):
    out, log = io.StringIO(), io.StringIO()
    echo = Echo(out, log)
    for line in text.splitlines(keepends=True):
        echo.feed(line)
    echo.close()
    assert echo.forgotten
    assert log.getvalue() == text  # the log keeps everything
    shown = out.getvalue()
    assert "terminated gracefully" in shown
    assert not re.search(r"Traceback|401|Connection attempt failed|mozilla|KeyboardInterrupt|File ", shown)
    assert "\n\n" not in shown


def test_node_output_filter_shows_other_tracebacks():
    other = Echo(out := io.StringIO(), io.StringIO())  # any other traceback is shown whole
    for line in ["Traceback (most recent call last):\n", '  File "a.py", line 1\n', "ValueError: bad\n"]:
        other.feed(line)
    assert not other.forgotten and out.getvalue().endswith("ValueError: bad\n")


PORT_TAKEN_LINE = (  # what uvicorn prints for the node's runtime API
    "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): "
    "address already in use"
)


@pytest.mark.slow  # 10-18 s: out of the default tier for its 10 minutes (CI's slow tier runs it)
def test_join_restarts_a_node_whose_port_was_taken(tmp_path, monkeypatch):
    """Another program binds the node's port between choosing and binding it: the node is
    started again on a new port; it keeps happening: one line that says so."""
    from fedpeft.flower import join

    monkeypatch.setattr(join.connect, "wait_for_superlink", lambda *a, **k: None)
    ports: list[int] = []

    def taken() -> list[str]:
        ports.append(free_port())
        line = PORT_TAKEN_LINE.format(port=ports[-1])
        return [sys.executable, "-c", f"print({line!r}); raise SystemExit(1)"]

    said: list[str] = []
    run = dict(cid=4, max_wait=5, log_path=tmp_path / "node.log", say=said.append, out=io.StringIO())
    gave_up = r"could not bind its local port, 3 times in a row: address already in use"
    with pytest.raises(join.DeployError, match=gave_up):
        join.run_node(taken, {}, "127.0.0.1:1", None, **run)
    assert len(set(ports)) == 3  # a new port each time
    assert sum("port was taken meanwhile; starting it on another" in s for s in said) == 2

    # taken once, then the node runs (and ends: here it leaves at once, which is its own error)
    commands = iter([taken(), *[[sys.executable, "-c", "pass"]] * 3])
    said.clear()
    with pytest.raises(join.DeployError, match=r"127\.0\.0\.1:1, 3 times"):
        join.run_node(lambda: next(commands), {}, "127.0.0.1:1", None, **run)
    assert "port was taken meanwhile" in said[1]

    # the user chose the port (--port): retrying cannot free it, so say so at once
    ports.clear()
    said.clear()
    with pytest.raises(join.DeployError, match=r"local port 4242 \(--port\): address already in use"):
        join.run_node(taken, {}, "127.0.0.1:1", None, fixed_port=4242, **run)
    assert len(ports) == 1 and not any("starting it on another" in s for s in said)


def test_example_configs_load_and_match_the_guide(tmp_path, monkeypatch):
    my = load_config(ROOT / "examples" / "my.yaml")
    guide = (ROOT / "docs" / "deployment.md").read_text()
    block = guide.split("<!-- walkthrough: one-machine-tls")[1].split("```")[1]
    joins = re.findall(r"^fedpeft join .*--partition-id (\d+)", block, flags=re.M)
    # one node per client, every client sampled every round: the walk-through's 3 joins
    assert sorted(int(j) for j in joins) == list(range(my.partition.num_clients))
    assert my.train.clients_per_round == my.partition.num_clients
    assert "examples/my.yaml" in block and my.data.task == "classification"

    hospital = (ROOT / "examples" / "hospital.yaml").read_text()
    for name in ("reference.csv", "reference-test.csv"):  # the server's own labelled files
        (tmp_path / name).write_text("text,label\na heart attack,cardio\na broken arm,ortho\n")
    (tmp_path / "hospital.yaml").write_text(hospital)
    monkeypatch.chdir(tmp_path)  # its data paths are relative to where serve runs
    cfg = load_config("hospital.yaml")
    assert cfg.data.source == "file" and cfg.partition.num_clients == cfg.train.clients_per_round == 3
    assert "examples/hospital.yaml" in guide


def test_serve_refuses_client_drift_before_starting_anything(tmp_path):
    """A deployed server never holds a client's model after its round, so ``eval.drift``
    is refused up front, naming the key (not silently left out of the records)."""
    result = CliRunner().invoke(
        app,
        ["serve", str(ROOT / "examples" / "my.yaml"), "--insecure", "--port", str(free_port()),
         "--set", "eval.drift=true", "--set", f"output_dir={tmp_path / 'run'}"],
    )  # fmt: skip
    assert result.exit_code != 0
    assert "eval.drift" in result.output and "fedpeft run" in result.output
    assert not (tmp_path / "run" / "flower").exists()  # no SuperLink was started


#: flower-supernode refused by an authenticating SuperLink (its key not enrolled), as logged
#: by Flower 1.41 (abridged).
NOT_ENROLLED_LOG = """\
\x1b[92mINFO \x1b[0m:      Starting Flower SuperNode
INFO:     Uvicorn running on http://127.0.0.1:49685 (Press CTRL+C to quit)
\x1b[93mWARNING \x1b[0m:   Connection attempt failed, retrying in 3.82 seconds
\x1b[91mERROR \x1b[0m:     Exit Code: 305
Failed to initialize the connection to the SuperLink.
[code: 2004] Failed to activate SuperNode.
The SuperNode could not establish a connection to the SuperLink.

For more information, visit: <https://flower.ai/docs/framework/1.41/en/ref-exit-codes/305.html>
INFO:     Shutting down
"""


def test_a_node_not_admitted_is_told_in_one_line():
    """The node's terminal shows none of Flower's exit message; the supervisor, seeing the
    refusal, says it in one line (``run_node``) and the command exits non-zero."""
    out, log = io.StringIO(), io.StringIO()
    echo = Echo(out, log)
    for line in NOT_ENROLLED_LOG.splitlines(keepends=True):
        echo.feed(line)
    echo.close()
    assert echo.refused and not echo.forgotten
    assert log.getvalue() == NOT_ENROLLED_LOG
    shown = out.getvalue()
    assert "Starting Flower SuperNode" in shown and "Shutting down" in shown
    assert not re.search(r"Exit Code|2004|activate|flower.ai|Connection attempt", shown)
    # another exit message is shown whole
    other = io.StringIO()
    echo = Echo(other, io.StringIO())
    for line in NOT_ENROLLED_LOG.replace(
        "[code: 2004] Failed to activate SuperNode.", "Disk full."
    ).splitlines(keepends=True):
        echo.feed(line)
    echo.close()
    assert not echo.refused and "Exit Code: 305" in other.getvalue() and "Disk full." in other.getvalue()


@pytest.mark.slow  # 10-18 s: out of the default tier for its 10 minutes (CI's slow tier runs it)
def test_join_retries_a_node_not_admitted_then_gives_up_in_one_line(tmp_path, monkeypatch):
    """Not admitted (its key not enrolled yet): retried for the grace (at most --max-wait),
    then one line; admitted on a retry (enrolled meanwhile), the node runs on."""
    from fedpeft.flower import join

    monkeypatch.setattr(join.connect, "wait_for_superlink", lambda *a, **k: None)
    monkeypatch.setattr(join, "REFUSAL_RETRY_SECONDS", 0.05)
    refused = [sys.executable, "-c", f"print({NOT_ENROLLED_LOG!r}); raise SystemExit(1)"]
    said: list[str] = []
    run = dict(cid=2, max_wait=1, log_path=tmp_path / "node.log", say=said.append, out=io.StringIO())
    tries: list[int] = []

    def command() -> list[str]:
        tries.append(1)
        return refused

    with pytest.raises(join.DeployError, match=r"refused this node: .*enrolled nodes"):
        join.run_node(command, {}, "127.0.0.1:1", None, **run)
    assert len(tries) >= 2  # retried within the grace (here --max-wait, 1 s)
    assert sum("does not admit this node; retrying for up to 1 s" in s for s in said) == 1
    assert "Exit Code" not in run["out"].getvalue()

    # enrolled while it retried: admitted on the second try, and it runs (here: stops at once,
    # which ends the test with the quick-exit error, not the refusal)
    admitted = [sys.executable, "-c", "print('\\x1b[92mINFO \\x1b[0m:      SuperNode ID: 7')"]
    commands = iter([refused, admitted, admitted, admitted])
    with pytest.raises(join.DeployError, match="stopped right after joining"):
        join.run_node(lambda: next(commands), {}, "127.0.0.1:1", None, **{**run, "max_wait": 30})


def test_a_federations_logs_are_quoted_by_their_ends(tmp_path):
    """What a deployed run that failed or hung shows: the end of every log (SuperLink,
    SuperNodes, the nodes' workers), each under its path."""
    from fedpeft.flower.deploy import Federation

    (tmp_path / "superlink.log").write_text("x" * 5000 + "superlink end")
    (tmp_path / "supernode-1.log").write_text("node 1 end")
    (tmp_path / "node-1").mkdir()
    (tmp_path / "node-1" / "worker-1.log").write_text("worker 1 end")
    text = Federation(tmp_path, "127.0.0.1:1", None).log_tails(chars=100)
    sections = text.split("--- ")[1:]
    logs = ["superlink.log", "supernode-1.log", "node-1/worker-1.log"]
    assert [s.splitlines()[0] for s in sections] == [str(tmp_path / log) for log in logs]
    assert sections[0].rstrip().endswith("superlink end") and len(sections[0]) < 100 + 200
    assert "node 1 end" in sections[1] and "worker 1 end" in sections[2]
