"""No secret written out (issue 72, item 5): a credential in the config (a token in
``log.mlflow_uri``) is used, but never written or sent: not in config.yaml, an export, the
trackers' records, fedpeft.log, the console, nor the run config a deployment sends to its
nodes. A config read back redacted takes the credential from the environment, and a run's
identity (its fingerprint) holds none."""

import base64
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, Field
from typer.testing import CliRunner

from fedpeft.config import REDACTED, ConfigError, dump_config, load_config, public_config, scrub
from fedpeft.config.secrets import identity_dump, redact_uri, secret_fields
from fedpeft.experiment import build, fingerprint, run
from fedpeft.report.results import read_records
from fedpeft.report.tracking import mlflow_target
from tests.helpers.runs import Killed, die_on_fit

TOKEN = "tok-7f3a9c2e51d84b06"
USERNAME, PASSWORD = "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"


@pytest.fixture(autouse=True)
def no_credentials_in_the_environment(monkeypatch):
    for name in (USERNAME, PASSWORD, "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(name, raising=False)


class FakeMlflowServer:
    """The few endpoints of MLflow's REST API a tracked run calls, on 127.0.0.1: every
    request's basic-auth credentials, and the params and metrics it was sent."""

    def __init__(self) -> None:
        self.auth: list[str | None] = []
        self.params: dict[str, str] = {}
        self.metrics: list[dict] = []
        self.status: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self.answer()

            def do_POST(self) -> None:
                self.answer()

            def answer(self) -> None:
                size = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(size) or b"{}")
                auth = self.headers.get("Authorization")
                server.auth.append(base64.b64decode(auth.split()[1]).decode() if auth else None)
                status, out = 200, server.reply(self.path.split("?")[0], body)
                if out is None:
                    status, out = 404, {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "none"}
                data = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.http.server_address[1]
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def reply(self, path: str, body: dict) -> dict | None:
        info = {"run_id": "r1", "run_uuid": "r1", "experiment_id": "1", "lifecycle_stage": "active"}
        if path.endswith("experiments/get-by-name"):
            return None
        if path.endswith("experiments/create"):
            return {"experiment_id": "1"}
        if path.endswith("runs/create"):
            return {"run": {"info": {**info, "status": "RUNNING"}, "data": {}}}
        if path.endswith("runs/log-batch"):
            self.params.update({p["key"]: p["value"] for p in body.get("params", [])})
            self.metrics += body.get("metrics", [])
        if path.endswith("runs/update"):
            self.status.append(body.get("status"))
            return {"run_info": {**info, "status": body.get("status")}}
        return {}

    def uri(self, userinfo: str = f"user:{TOKEN}") -> str:
        return f"http://{userinfo}@127.0.0.1:{self.port}"


@pytest.fixture
def mlflow_server():
    server = FakeMlflowServer()
    yield server
    server.http.shutdown()
    server.http.server_close()


def files_holding(folder: Path, secret: str) -> list[str]:
    """Every file under ``folder`` whose bytes hold ``secret``."""
    return [str(p) for p in folder.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


# ------------------------------------------------------------------ what is secret


def test_a_uri_keeps_all_but_its_credentials():
    assert redact_uri(f"https://user:{TOKEN}@host:5000/p") == "https://user:***@host:5000/p"
    assert redact_uri(f"https://{TOKEN}@host") == "https://***@host"  # a token as the user
    assert redact_uri(f"https://host/?x=1&access_token={TOKEN}#f") == "https://host/?x=1&access_token=***#f"
    assert (
        redact_uri(f"postgresql://u:{TOKEN}@db/x?sslmode=require")
        == "postgresql://u:***@db/x?sslmode=require"
    )
    for plain in ("sqlite:///a/b.db", "http://host:5000", "file:///tmp/mlruns"):
        assert redact_uri(plain) == plain  # written as it was


class Hub(BaseModel):
    hub_token: str | None = None
    private: str = Field("", json_schema_extra={"secret": True})
    endpoint_url: str = "https://hub"
    max_new_tokens: int = 4


class Declared(BaseModel):
    hub: Hub = Hub()
    hubs: list[Hub] = []


def test_fields_named_or_declared_secret_are_redacted_whole():
    cfg = Declared(
        hub=Hub(hub_token=TOKEN, private=TOKEN, endpoint_url=f"https://u:{TOKEN}@h"),
        hubs=[Hub(hub_token=TOKEN)],
    )
    kinds = {".".join(map(str, path)): kind for path, kind, _ in secret_fields(cfg)}
    assert kinds == {
        "hub.hub_token": "secret",
        "hub.private": "secret",
        "hub.endpoint_url": "uri",
        "hubs.0.endpoint_url": "uri",
        "hubs.0.hub_token": "secret",
    }
    public = public_config(cfg)
    assert TOKEN not in json.dumps(public)
    assert public["hub"] == {
        "hub_token": REDACTED,
        "private": REDACTED,
        "endpoint_url": "https://u:***@h",
        "max_new_tokens": 4,
    }
    identity = identity_dump(cfg)  # no credential at all, not even a redacted one
    assert identity["hub"] == {"endpoint_url": "https://h", "max_new_tokens": 4}


def test_scrub_takes_credentials_out_of_text(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_" + TOKEN)
    text = f"no store at 'https://user:{TOKEN}@host/api?token={TOKEN}&n=1'; hub said hf_{TOKEN}"
    assert scrub(text) == "no store at 'https://user:***@host/api?token=***&n=1'; hub said ***"


# ------------------------------------------------------------------ the credential still arrives


def test_mlflow_gets_a_servers_credentials_from_its_environment_and_a_databases_in_its_uri(monkeypatch):
    assert mlflow_target(f"https://user:{TOKEN}@host") == (
        "https://host",
        {USERNAME: "user", PASSWORD: TOKEN},
    )
    # no credential in the URI: the user's own environment, which MLflow reads itself
    assert mlflow_target("https://host") == ("https://host", {})
    assert mlflow_target(f"postgresql://u:{TOKEN}@db/x") == (f"postgresql://u:{TOKEN}@db/x", {})
    # read back redacted: the environment's, or one line naming the key and the variable
    with pytest.raises(ConfigError, match=f"^log.mlflow_uri: its password was redacted .*set {PASSWORD} "):
        mlflow_target("https://user:***@host")
    with pytest.raises(ConfigError, match=f"log.mlflow_uri: its user .*set {USERNAME} "):
        mlflow_target("https://***@host")
    with pytest.raises(
        ConfigError, match="log.mlflow_uri: the value of its query parameter 'token' was redacted"
    ):
        mlflow_target("https://host/?token=***")
    monkeypatch.setenv(PASSWORD, TOKEN)
    assert mlflow_target("https://user:***@host") == ("https://host", {USERNAME: "user", PASSWORD: TOKEN})
    assert mlflow_target("postgresql://u:***@db/x") == (f"postgresql://u:{TOKEN}@db/x", {})


def test_the_fingerprint_is_the_same_with_the_token_in_the_uri_redacted_or_in_the_environment(tiny_config):
    given = tiny_config(**{"log.mlflow_uri": f"https://user:{TOKEN}@host", "log.to": ["mlflow"]})
    moved = tiny_config(**{"log.mlflow_uri": "https://host", "log.to": ["mlflow"]})
    read_back = yaml.safe_load(dump_config(given))
    assert read_back["log"]["mlflow_uri"] == "https://user:***@host"
    redacted = given.model_validate(read_back)
    assert fingerprint(given) == fingerprint(moved) == fingerprint(redacted)


def test_the_run_config_sent_to_the_nodes_holds_no_token(tiny_config, tmp_path, mlflow_server, monkeypatch):
    """``fedpeft serve`` sends the config in its app's pyproject.toml: redacted. The ServerApp
    (here on the in-memory grid of tests/helpers/flower.py) reads it back so, and its tracker
    takes the password from the environment of the SuperLink's machine."""
    import tomllib

    from flwr.app import Context, RecordDict

    from fedpeft.flower import apps
    from fedpeft.flower.deploy import write_app
    from tests.helpers.flower import FakeGrid

    cfg = tiny_config(**{"log.mlflow_uri": mlflow_server.uri(), "log.to": ["mlflow"]})
    app = write_app(tmp_path / "app", cfg, resume=False)
    assert files_holding(app, TOKEN) == []
    run_config = tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    served = apps.experiment_of(Context(1, 0, {}, RecordDict(), run_config))
    assert served.log.mlflow_uri == mlflow_server.uri("user:***")
    assert fingerprint(served) == fingerprint(cfg)  # the server runs (and resumes) the same experiment
    with pytest.raises(ConfigError, match=f"^log.mlflow_uri: its password was redacted .* set {PASSWORD} in"):
        mlflow_target(served.log.mlflow_uri)

    monkeypatch.setenv(PASSWORD, TOKEN)  # the SuperLink's environment
    nodes = {100 + i: {"partition-id": i, "state-dir": str(tmp_path / f"node{i}")} for i in range(4)}
    grid = FakeGrid(apps.client_app, nodes, run_config)
    try:
        apps.server_app(grid, Context(7, 0, {}, RecordDict(), grid.run_config))
    finally:
        apps._nodes.clear()
    assert [r["round"] for r in read_records(cfg.output_dir)] == [1, 2]
    assert mlflow_server.auth and set(mlflow_server.auth) == {f"user:{TOKEN}"}
    assert mlflow_server.status[-1] == "FINISHED"
    assert files_holding(tmp_path, TOKEN) == []  # the server's run folder, the nodes' state


# ------------------------------------------------------------------ runs


def test_a_run_with_a_token_in_the_mlflow_uri_writes_it_nowhere_and_its_server_gets_it(
    tiny_config, tmp_path, mlflow_server, monkeypatch
):
    """Through the CLI, the token given on the command line: TensorBoard, MLflow (a server
    that checks the credentials of every request) and W&B (offline, its files in the run
    folder, the command line among them) track the run; no file of the run, its export or
    its trackers holds the token, nor does the console or fedpeft.log."""
    import wandb

    from fedpeft import load_export
    from fedpeft.cli import app

    path = tmp_path / "exp.yaml"
    path.write_text(dump_config(tiny_config()))
    uri = mlflow_server.uri()
    argv = ["run", str(path), "--set", f"log.mlflow_uri={uri}", "--set", "log.to=[tensorboard,mlflow,wandb]"]
    monkeypatch.setattr(sys, "argv", ["fedpeft", *argv])  # as W&B reads the command line
    res = CliRunner().invoke(app, argv)
    wandb.teardown()  # W&B's service has written all it was sent
    assert res.exit_code == 0, res.output
    out = tmp_path / "run"
    assert TOKEN not in res.output
    assert files_holding(out, TOKEN) == []
    for name in ("config.yaml", "fedpeft.log", "tracking.json", "adapter/fedpeft_model.json"):
        assert (out / name).is_file(), name
    assert list((out / "tensorboard").iterdir()) and list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    # the server was sent every request with the credentials, the config redacted, every round
    assert mlflow_server.auth and set(mlflow_server.auth) == {f"user:{TOKEN}"}
    assert mlflow_server.params["log.mlflow_uri"] == mlflow_server.uri("user:***")
    assert {m["step"] for m in mlflow_server.metrics if m["key"] == "loss"} == {1, 2}
    assert mlflow_server.status[-1] == "FINISHED"
    assert PASSWORD not in os.environ  # set for the tracked run only
    # the export, redacted, still loads
    model = load_export(out / "adapter")
    assert model is not None


def test_a_redacted_config_yaml_resumes_with_the_token_from_the_environment(
    tiny_config, mlflow_server, monkeypatch
):
    cfg = tiny_config(**{"train.rounds": 3, "log.mlflow_uri": mlflow_server.uri(), "log.to": ["mlflow"]})
    setup = build(cfg)
    die_on_fit(setup)  # in round 3
    with pytest.raises(Killed):
        run(cfg, setup=setup)
    out = Path(cfg.output_dir)
    read_back = load_config(out / "config.yaml")
    assert read_back.log.mlflow_uri == mlflow_server.uri("user:***")
    assert fingerprint(read_back) == fingerprint(cfg)
    # no password in the environment: refused in one line before anything runs, never sent as ***
    asked, written = len(mlflow_server.auth), (out / "metrics.jsonl").stat().st_mtime_ns
    with pytest.raises(ConfigError, match=f"^log.mlflow_uri: its password was redacted .* set {PASSWORD} in"):
        run(read_back, resume=True)
    assert len(mlflow_server.auth) == asked and (out / "metrics.jsonl").stat().st_mtime_ns == written
    monkeypatch.setenv(PASSWORD, TOKEN)
    run(read_back, resume=True)  # the checkpoint's experiment: not refused as another one
    assert [r["round"] for r in read_records(out)] == [1, 2, 3]
    assert set(mlflow_server.auth) == {f"user:{TOKEN}"}
    assert {m["step"] for m in mlflow_server.metrics if m["key"] == "loss"} == {1, 2, 3}
    assert mlflow_server.status[-2:] == ["RUNNING", "FINISHED"]  # the same tracked run, continued
    assert files_holding(out, TOKEN) == []


def test_an_error_quoting_the_uri_shows_no_token_on_the_console_nor_in_fedpeft_log(
    tiny_config, tmp_path, monkeypatch
):
    """A database URI keeps its credentials (its driver's only way to get them): an error
    that quotes it is told without them, on the console and in fedpeft.log's traceback."""
    import mlflow

    from fedpeft.cli import app

    def unreachable(tracking_uri):
        raise RuntimeError(f"no tracking store at {tracking_uri!r}")

    monkeypatch.setattr(mlflow, "MlflowClient", unreachable)
    path = tmp_path / "exp.yaml"
    path.write_text(dump_config(tiny_config()))
    uri = f"postgresql://user:{TOKEN}@127.0.0.1:1/db"
    res = CliRunner().invoke(
        app, ["run", str(path), "--set", f"log.mlflow_uri={uri}", "--set", "log.to=[mlflow]"]
    )
    assert res.exit_code == 2
    assert "no tracking store at 'postgresql://user:***@127.0.0.1:1/db'" in res.output
    assert TOKEN not in res.output
    log = (tmp_path / "run" / "fedpeft.log").read_text()
    assert "Traceback" in log and "postgresql://user:***@127.0.0.1:1/db" in log
    assert files_holding(tmp_path / "run", TOKEN) == []
