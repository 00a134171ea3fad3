"""Only the operator steers a deployment (issue 72, item 1).

- Cheap checks (no Flower process): operator tokens and signed apps
  (:mod:`fedpeft.flower.operator`), the SuperLink's gate (:mod:`fedpeft.flower.superlink`)
  on requests from this machine and from others, a node refusing an app its operator did
  not sign (:mod:`fedpeft.flower.supernode`), private keys never open to others, ``certs``
  keeping a CA, ``--insecure`` off loopback.
- One real SuperLink on loopback (TLS, SuperNode authentication): from a folder holding
  only the CA certificate and its own key pair, enrolling, revoking and submitting a run
  are refused, the enrolled nodes are unchanged and the operator's node still joins;
  the operator's own ``enrol``/``revoke`` work as docs/deployment.md says.
"""

from __future__ import annotations

import datetime as dt
import io
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import tomli_w
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from typer.testing import CliRunner

from fedpeft.cli import app
from fedpeft.flower import control, deploy, operator, supernode
from fedpeft.flower.certs import make_certificates, make_node_keys
from fedpeft.flower.superlink import Gate

ROOT = Path(__file__).resolve().parents[2]
FEDPEFT = str(Path(sys.executable).parent / "fedpeft")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The deployment's certificates, and another CA's (a stranger's own `fedpeft certs`)."""
    work = tmp_path_factory.mktemp("pki")
    return make_certificates(work / "ours", ["127.0.0.1", "localhost"]), make_certificates(
        work / "theirs", ["127.0.0.1"]
    )


def _cert_without_operator_usage(paths, out: Path) -> operator.Operator:
    """A certificate the deployment's CA issued, but not for an operator (as the
    SuperLink's own certificate is): its key signs, its usage does not allow."""
    ca = x509.load_pem_x509_certificate(paths["ca.crt"].read_bytes())
    ca_key = serialization.load_pem_private_key(paths["ca.key"].read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "a node")]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .sign(ca_key, hashes.SHA256())
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "operator.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (out / "operator.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return operator.Operator.at(out / "operator.key")


def test_only_the_operators_token_opens_the_control_api(pki, tmp_path):
    ours, theirs = pki
    check = operator.TokenCheck(operator.load_ca(ours["ca.crt"]))
    mine = operator.Operator.at(ours["operator.key"])
    check(operator.mint_token(mine))  # the operator's: good
    refusals = {
        "another CA's operator": operator.mint_token(operator.Operator.at(theirs["operator.key"])),
        "our CA, not an operator": operator.mint_token(_cert_without_operator_usage(ours, tmp_path / "n")),
        "expired": operator.mint_token(mine, now=time.time() - operator.TOKEN_SECONDS - 60),
        "garbage": "abc.def.ghi",
    }
    reasons = {}
    for what, token in refusals.items():
        with pytest.raises(operator.Untrusted) as err:
            check(token)
        reasons[what] = str(err.value)
    assert "not issued by this deployment's CA" in reasons["another CA's operator"]
    assert "lacks fedpeft's operator key usage" in reasons["our CA, not an operator"]
    assert "expired" in reasons["expired"]
    assert "not an operator token" in reasons["garbage"]
    # a token whose signed body was changed (the time pushed forward) no longer verifies
    body, signature, cert = operator.mint_token(mine).split(".")
    forged = operator._b64(b'{"iat": 9999999999, "nonce": "x"}')
    with pytest.raises(operator.Untrusted, match="signature does not verify"):
        check(".".join([forged, signature, cert]))


def _fab(pyproject: dict, extra: dict[str, bytes] | None = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("pyproject.toml", tomli_w.dumps(pyproject))
        z.writestr(".info/CONTENT", "pyproject.toml,0,0")
        for name, data in (extra or {}).items():
            z.writestr(name, data)
    return buf.getvalue()


def _app(tiny_config, tmp_path, signer) -> dict:
    import tomllib

    path = deploy.write_app(tmp_path / "app", tiny_config(), False, signer)
    return tomllib.loads((path / "pyproject.toml").read_text())


def test_nodes_check_the_app_is_the_operators(pki, tiny_config, tmp_path):
    """What a node accepts (check_app): a fedpeft app signed by its CA's operator, whole."""
    ours, theirs = pki
    ca = operator.load_ca(ours["ca.crt"])
    signed = _app(tiny_config, tmp_path / "a", operator.Operator.at(ours["operator.key"]))
    config = operator.check_app(_fab(signed), ca)
    assert "experiment" in config and operator.SIGNATURE_KEY in config

    def refused(fab: bytes) -> str:
        with pytest.raises(operator.Untrusted) as err:
            operator.check_app(fab, ca)
        return str(err.value)

    tampered = _app(tiny_config, tmp_path / "b", operator.Operator.at(ours["operator.key"]))
    tampered["tool"]["flwr"]["app"]["config"]["experiment"] += "\nseed: 99\n"
    assert "does not verify" in refused(_fab(tampered))
    other = _app(tiny_config, tmp_path / "c", operator.Operator.at(theirs["operator.key"]))
    assert "not issued by this deployment's CA" in refused(_fab(other))
    assert "not signed" in refused(_fab(_app(tiny_config, tmp_path / "d", None)))
    assert "files a fedpeft app does not" in refused(_fab(signed, {"evil.py": b"import os"}))
    components = _app(tiny_config, tmp_path / "e", None)
    components["tool"]["flwr"]["app"]["components"]["clientapp"] = "evil:client_app"
    components = operator.sign_app(components, operator.Operator.at(ours["operator.key"]))
    assert "components are not fedpeft's" in refused(_fab(components))
    assert "not a fedpeft app" in refused(b"not a zip")
    bomb = io.BytesIO()  # a pyproject that unpacks to more than any config: refused unread
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("pyproject.toml", b" " * (operator.MAX_APP_BYTES + 1))
    assert "unpacks to" in refused(bomb.getvalue())


def test_a_node_answers_an_unsigned_run_with_an_error_and_runs_nothing(
    pki, tiny_config, tmp_path, monkeypatch
):
    """The SuperNode wrapper: Flower's pull step is given checking get_run/get_fab; an
    unsigned app or a run that overrides its config gets an error reply, a signed one
    goes through to Flower."""
    from flwr.app import Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity
    from flwr.supernode import start_client_internal as sci

    ours, _ = pki
    fabs = {
        "signed": _fab(_app(tiny_config, tmp_path / "s", operator.Operator.at(ours["operator.key"]))),
        "unsigned": _fab(_app(tiny_config, tmp_path / "u", None)),
    }
    stored, replies = [], []

    def flower_pull(*, receive, get_run, get_fab, state, object_store, **rest):  # Flower's order
        message, _ = receive()
        run = get_run(message.metadata.run_id)
        get_fab(run.fab_hash, message.metadata.run_id)
        stored.append(message.metadata.run_id)
        return message.metadata.run_id

    monkeypatch.setattr(sci, "_pull_and_store_message", flower_pull)
    monkeypatch.setattr(sci, "_insert_message", lambda reply, state, store: replies.append(reply))
    supernode.run_signed_apps_only(str(ours["ca.crt"]))

    def pull(run_id: int, fab: str, override: dict | None = None):
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, 0, 0
        message = Message(RecordDict(), dst_node_id=1, message_type="query")
        return sci._pull_and_store_message(
            receive=lambda: (message, None),
            get_run=lambda rid: SimpleNamespace(fab_hash=fab, override_config=override or {}),
            get_fab=lambda h, rid: SimpleNamespace(content=fabs[h]),
            state=None,
            object_store=None,
            node_config={},
        )

    assert pull(1, "signed") == 1 and stored == [1] and not replies
    assert pull(2, "unsigned") == 2 and stored == [1]
    assert pull(3, "signed", {"experiment": "seed: 1"}) == 3 and stored == [1]
    assert [r.has_error() for r in replies] == [True, True]
    assert "refused run 2" in replies[0].error.reason and "not signed" in replies[0].error.reason
    assert "overrides its signed run config" in replies[1].error.reason


def _scope(path: str, client: str, token: str | None = None, server: str = "127.0.0.1") -> dict:
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    return {
        "type": "http",
        "path": path,
        "method": "POST",
        "client": (client, 5000),
        "server": (server, 9092),
        "headers": headers,
    }


def test_the_gate_lets_nodes_through_and_the_operator_alone_steer(pki):
    ours, theirs = pki
    check = operator.TokenCheck(operator.load_ca(ours["ca.crt"]))
    good = operator.mint_token(operator.Operator.at(ours["operator.key"]))
    bad = operator.mint_token(operator.Operator.at(theirs["operator.key"]))
    local_gate = Gate(None, check, remote=False, say=print)
    remote_gate = Gate(None, check, remote=True, say=print)
    plain_gate = Gate(None, None, remote=True, say=print)  # --insecure: no credential exists

    def status(gate, *args, **kw):
        refused = gate.refusal(_scope(*args, **kw))
        return 200 if refused is None else refused[0]

    far, near = "10.1.2.3", "127.0.0.1"
    # the nodes' API and the health check: for anyone (Flower's node authentication applies)
    assert status(local_gate, "/v1/fleet/pull-messages", far) == 200
    assert status(local_gate, "/health", far) == 200
    # the Control API: the operator's token, and from this machine unless --remote-operator
    assert status(local_gate, "/v1/control/register-node", near, good) == 200
    assert status(local_gate, "/v1/control/register-node", near) == 401
    assert status(local_gate, "/v1/control/register-node", near, bad) == 403
    assert status(local_gate, "/v1/control/start-run", far, good) == 403
    assert status(remote_gate, "/v1/control/start-run", far, good) == 200
    assert status(remote_gate, "/v1/control/start-run", far, bad) == 403
    # a connection to this machine's own address from that address is this machine
    assert status(local_gate, "/v1/control/list-nodes", "10.0.0.5", good, server="10.0.0.5") == 200
    # the Runtime API (ServerApp tasks) and anything else: this machine only
    assert status(remote_gate, "/v1/runtime/acquire-task", far, good) == 403
    assert status(local_gate, "/v1/runtime/acquire-task", near) == 200
    assert status(local_gate, "/docs", far) == 403
    # without TLS: this machine only, whatever was asked
    assert status(plain_gate, "/v1/control/start-run", near) == 200
    assert status(plain_gate, "/v1/control/start-run", far) == 403


def test_private_keys_are_never_open_to_others_and_a_ca_is_kept(tmp_path, monkeypatch):
    """Every private key ``certs``/``keys`` write is 0600 while it is being written (not
    chmod-ed after); a second ``certs`` into the same folder refuses to replace the CA."""
    modes: dict[str, int] = {}
    real_fdopen = os.fdopen

    def watching_fdopen(fd, *args, **kw):
        handle = real_fdopen(fd, *args, **kw)
        write = handle.write

        def checked_write(data):
            modes[os.readlink(f"/proc/self/fd/{fd}")] = os.fstat(fd).st_mode & 0o777
            return write(data)

        handle.write = checked_write
        return handle

    old = os.umask(0)  # the most open umask: the mode must come from fedpeft itself
    try:
        monkeypatch.setattr(os, "fdopen", watching_fdopen)
        res = CliRunner().invoke(app, ["certs", str(tmp_path / "c"), "--nodes", "1"])
        assert res.exit_code == 0, res.output
        res = CliRunner().invoke(app, ["keys", str(tmp_path / "k"), "5"])
        assert res.exit_code == 0, res.output
    finally:
        os.umask(old)
        monkeypatch.undo()
    written = {Path(p).name.split(".")[1] if Path(p).name.startswith(".") else Path(p).name for p in modes}
    assert {"ca", "server", "operator", "node-0", "node-5"} <= written, modes
    assert set(modes.values()) == {0o600}
    for key in ["c/ca.key", "c/server.key", "c/operator.key", "c/nodes/node-0.key", "k/node-5.key"]:
        assert (tmp_path / key).stat().st_mode & 0o777 == 0o600, key
    assert (tmp_path / "c/ca.crt").stat().st_mode & 0o077  # certificates are public

    ca_key = (tmp_path / "c/ca.key").read_bytes()
    res = CliRunner().invoke(app, ["certs", str(tmp_path / "c")])
    assert res.exit_code == 2 and "ca.key exists" in res.output and "--overwrite-ca" in res.output
    assert (tmp_path / "c/ca.key").read_bytes() == ca_key
    res = CliRunner().invoke(app, ["certs", str(tmp_path / "c"), "--overwrite-ca"])
    assert res.exit_code == 0 and (tmp_path / "c/ca.key").read_bytes() != ca_key


@pytest.mark.parametrize(
    "args",
    [
        ["superlink", "--insecure"],  # its default --host is 0.0.0.0
        ["superlink", "--insecure", "--host", "10.0.0.5"],
        ["serve", "--insecure", "--superlink", "fl.example.org:9092"],
        ["join", "--insecure", "--superlink", "10.0.0.5:9092", "--partition-id", "0"],
    ],
    ids=["superlink-default-host", "superlink-host", "serve", "join"],
)
def test_insecure_off_loopback_is_refused_unless_said_plainly(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2
    assert "in the clear" in res.output and "--plaintext-on-network" in res.output
    assert "Traceback" not in res.output


def test_the_flag_that_allows_plaintext_on_a_network_is_honoured(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(
        app,
        [
            "join",
            "--insecure",
            "--plaintext-on-network",
            "--superlink",
            "10.255.255.1:9",
            "--partition-id",
            "0",
            "--max-wait",
            "1",
        ],
    )
    assert "in the clear" not in res.output  # past the check: it tried the address, and gave up
    assert "10.255.255.1:9" in res.output


# ---------------------------------------------------------------- a real SuperLink
def _fedpeft(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([FEDPEFT, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.deploy
@pytest.mark.xdist_group("control_plane")
def test_a_stranger_with_the_ca_certificate_cannot_enrol_revoke_or_run(tmp_path):
    """The operator's SuperLink (TLS, enrolled nodes only, as the guide starts it); a
    stranger's folder holds the CA certificate every node is handed and its own key pair
    (and, to make sure the refusal is the SuperLink's, an operator credential of its own
    CA). Enrolling, revoking the operator's node and submitting a run are all refused;
    the enrolled nodes are the same and the operator's node still joins; the operator's
    own enrol and revoke work as the guide says."""
    op = tmp_path / "operator"
    make_certificates(op / "runs/certs", ["127.0.0.1", "localhost"])
    make_node_keys(op / "runs/certs/nodes", range(2))
    port = deploy.free_port()
    link = f"127.0.0.1:{port}"
    superlink = subprocess.Popen(
        [
            FEDPEFT,
            "superlink",
            "--ca",
            "runs/certs/ca.crt",
            "--cert",
            "runs/certs/server.pem",
            "--key",
            "runs/certs/server.key",
            "--enrolled",
            "runs/certs/nodes",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        cwd=op,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    node = None
    try:
        said = ""
        while "SuperLink listening" not in said:
            line = superlink.stdout.readline()
            assert line, f"fedpeft superlink ended: {said}"
            said += line
        enrolled = dict(line.split(" as node ") for line in said.splitlines() if " as node " in line)
        assert set(enrolled) == {"enrolled node-0.pub", "enrolled node-1.pub"}
        node_0 = enrolled["enrolled node-0.pub"].strip()
        tls = deploy.Tls(op / "runs/certs/ca.crt")
        before = control.enrolled_nodes(link, tls, tmp_path / "check")

        stranger = tmp_path / "stranger"
        stranger.mkdir()
        shutil.copy(op / "runs/certs/ca.crt", stranger / "ca.crt")
        assert _fedpeft("keys", ".", "7", cwd=stranger).returncode == 0
        # with nothing but the CA certificate: there is no operator credential to use
        res = _fedpeft("enrol", "node-7.pub", "--superlink", link, "--ca", "ca.crt", cwd=stranger)
        assert res.returncode == 2 and "no operator credential" in res.stdout + res.stderr
        # with an "operator" credential of its own making: the SuperLink refuses it
        assert _fedpeft("certs", "own", cwd=stranger).returncode == 0
        own = ["--superlink", link, "--ca", "ca.crt", "--operator", "own/operator.key"]
        res = _fedpeft("enrol", "node-7.pub", *own, cwd=stranger)
        assert res.returncode == 2 and "not the operator" in res.stdout + res.stderr, res.stdout + res.stderr
        res = _fedpeft("revoke", node_0, *own, cwd=stranger)
        assert res.returncode == 2 and "not the operator" in res.stdout + res.stderr, res.stdout + res.stderr
        shutil.copy(ROOT / "examples/my.yaml", stranger / "my.yaml")
        res = _fedpeft("serve", "my.yaml", *own, cwd=stranger)
        assert res.returncode == 2 and "not the operator" in res.stdout + res.stderr, res.stdout + res.stderr
        # and straight through Flower's own CLI, with no credential at all
        home = stranger / "flwr-home"
        home.mkdir()
        (home / "config.toml").write_text(
            tomli_w.dumps(
                {
                    "superlink": {
                        "default": "x",
                        "x": {"address": link, "root-certificates": str(stranger / "ca.crt")},
                    }
                }
            )
        )
        flwr = str(Path(sys.executable).parent / "flwr")
        env = {**os.environ, "FLWR_HOME": str(home)}
        for args in (
            ["supernode", "register", "node-7.pub", "x"],
            ["supernode", "unregister", node_0, "x"],
            ["run", str(stranger), "x"],
        ):
            res = subprocess.run(
                [flwr, *args], cwd=stranger, env=env, capture_output=True, text=True, timeout=120
            )
            assert res.returncode != 0, (args, res.stdout)
        log = (op / "runs/superlink/superlink.log").read_text()
        assert log.count("fedpeft gate: refused POST /v1/control/") >= 5

        assert control.enrolled_nodes(link, tls, tmp_path / "check") == before  # nothing enrolled or revoked
        node = deploy.start_supernode(  # the operator's node still joins
            tmp_path / "node",
            link,
            0,
            tls=tls,
            key=op / "runs/certs/nodes/node-0.key",
            log=tmp_path / "node.log",
        )
        assert _online(link, tls, tmp_path / "check", int(node_0)), (tmp_path / "node.log").read_text()[
            -2000:
        ]

        # the operator, as docs/deployment.md does it (run where the SuperLink runs)
        assert _fedpeft("keys", "runs/certs/nodes", "3", cwd=op).returncode == 0
        res = _fedpeft(
            "enrol", "runs/certs/nodes/node-3.pub", "--superlink", link, "--ca", "runs/certs/ca.crt", cwd=op
        )
        assert res.returncode == 0 and "enrolled runs/certs/nodes/node-3.pub as node" in res.stdout, (
            res.stdout
        )
        res = _fedpeft(
            "revoke", "runs/certs/nodes/node-3.pub", "--superlink", link, "--ca", "runs/certs/ca.crt", cwd=op
        )
        assert res.returncode == 0 and "revoked node" in res.stdout, res.stdout + res.stderr
        # no operator token is left on disk once the calls are over
        assert not [*op.rglob("credentials.yaml"), *(tmp_path / "check").rglob("credentials.yaml")]
        assert control.enrolled_nodes(link, tls, tmp_path / "check") == before
    finally:
        for proc in (node, superlink):
            if proc is not None:
                deploy.stop(proc)


def _online(link: str, tls, workdir: Path, node_id: int, wait: float = 120) -> bool:
    """Whether node ``node_id`` is connected to the SuperLink within ``wait`` s."""
    deadline = time.monotonic() + wait
    home = workdir / "home-cli"
    while time.monotonic() < deadline:
        control.write_connection(home, link, tls)
        proc = control.flwr(home, "supernode", "ls", control.CONNECTION, "--format", "json", check=False)
        for entry in control.json_tail(proc.stdout).get("nodes", []):
            if int(entry["node-id"]) == node_id and entry.get("status") == "online":
                return True
        time.sleep(1)
    return False
