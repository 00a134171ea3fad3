"""The deployment commands, over Flower: serve (one run), superlink (a long-lived
SuperLink for many runs) and join (one client, until stopped).

Each starts Flower's processes inside ``CommandProcesses``: however the command ends, no
process it started is left. Flower is imported when a command runs, not before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, NoReturn

import typer

from fedpeft.cli import common
from fedpeft.cli.common import ConfigArg, SetOpt, fail, read_config
from fedpeft.cli.security import CaOpt, InsecureOpt, OperatorOpt, PlaintextOpt, plaintext_check, tls_setting
from fedpeft.cli.tables import print_summaries
from fedpeft.config import ConfigError, ExperimentConfig

app = typer.Typer()

HostOpt = Annotated[str, typer.Option(help="Interface the SuperLink listens on (0.0.0.0: all).")]
PortOpt = Annotated[int, typer.Option(help="The SuperLink's port (one port: nodes and runs alike).")]
CertOpt = Annotated[Path | None, typer.Option(help="SuperLink certificate (TLS).")]  # noqa: UP007
KeyOpt = Annotated[Path | None, typer.Option(help="SuperLink private key (TLS).")]  # noqa: UP007
EnrolledOpt = Annotated[
    Path | None,  # noqa: UP007
    typer.Option(
        help="A folder of node public keys (*.pub, from `fedpeft certs --nodes N`) enrolled at start."
    ),
]
RemoteOperatorOpt = Annotated[
    bool,
    typer.Option(
        "--remote-operator",
        help="Let the operator reach the Control API (enrol, revoke, runs) from other machines too, "
        "with the operator's credential (TLS only). Default: from this machine only.",
    ),
]
AuthOpt = Annotated[
    bool | None,  # noqa: UP007
    typer.Option(
        "--auth/--no-auth",
        help="SuperNode authentication: only enrolled nodes join (default: on with TLS; Flower allows "
        "it over TLS only).",
    ),
]


def _say(prefix: str):
    from rich.markup import escape

    return lambda line: common.console.print(f"[bold]{prefix}:[/] {escape(line)}", soft_wrap=True)


def _join_hint(address: str, ca: Path | None, auth: bool = False) -> str:
    security = f"--ca {ca}" if ca is not None else "--insecure"
    signing = " --key NODE_KEY" if auth else ""
    return f"fedpeft join --superlink {address} {security}{signing} --partition-id N --state-dir DIR"


def _auth(auth: bool | None, tls, enrolled: Path | None) -> bool:
    """Whether the SuperLink authenticates nodes: on with TLS unless --no-auth."""
    on = tls is not None if auth is None else auth
    if on and tls is None:
        fail(ValueError("--auth: Flower authenticates SuperNodes over TLS only; give --ca, --cert, --key"))
    if enrolled is not None and not on:
        fail(ValueError(f"--enrolled {enrolled}: enrolment needs SuperNode authentication (drop --no-auth)"))
    if enrolled is not None and not enrolled.is_dir():
        fail(FileNotFoundError(f"--enrolled {enrolled}: no such folder"))
    return on


def _enrol_folder(address: str, enrolled: Path | None, tls, work: Path) -> None:
    """Enrol every public key of ``enrolled`` with the SuperLink just started at ``address``."""
    from fedpeft.flower import control

    keys = sorted(enrolled.glob("*.pub")) if enrolled is not None else []
    for key in keys:
        node = control.enrol(address, key, tls, work, name=key.stem)
        common.console.print(f"enrolled {key.name} as node {node}", soft_wrap=True)
    if not keys:
        common.console.print(
            "no node enrolled yet: this SuperLink admits enrolled nodes only (--enrolled DIR at start, "
            f"or `fedpeft enrol KEY.pub --superlink {address} --ca CA` while it runs; --no-auth: anyone)",
            soft_wrap=True,
        )


def _public_address(host: str, port: int) -> str:
    from fedpeft.flower.connect import WILDCARDS, join_address

    return join_address("<this host>" if host in WILDCARDS else host, port)


def _serve_stopped(stop, cfg: ExperimentConfig) -> NoReturn:
    """``fedpeft serve`` stopped by a signal: what became of the run; the shell's exit code."""
    again = (
        "`fedpeft serve` with the same options and --resume continues it from its last completed round"
        if cfg.checkpoint.enabled
        else "it kept no checkpoint (checkpoint: false): run it again from the start"
    )
    common.console.print(
        f"fedpeft serve: stopped by {stop.name}, the run with it, and every process serve started; {again}",
        soft_wrap=True,
    )
    raise typer.Exit(stop.exit_code)


@app.command()
def serve(
    config: ConfigArg = None,
    set_: SetOpt = None,
    resume: Annotated[bool, typer.Option(help="Continue from the last completed round.")] = False,
    resume_from: Annotated[
        int | None,  # noqa: UP007
        typer.Option(
            "--resume-from",
            metavar="ROUND",
            min=1,
            help="Continue from round ROUND's kept checkpoint (checkpoint.keep says how many are kept); "
            "the later ones are deleted. Nodes keep their state of as many rounds.",
        ),
    ] = None,
    superlink: Annotated[
        str | None,  # noqa: UP007
        typer.Option(
            help="A running SuperLink (HOST:PORT, e.g. from `fedpeft superlink`) to submit the run to; "
            "default: start one here for this run only."
        ),
    ] = None,
    host: HostOpt = "0.0.0.0",
    port: PortOpt = 9092,
    ca: CaOpt = None,
    cert: CertOpt = None,
    key: KeyOpt = None,
    insecure: InsecureOpt = False,
    plaintext_on_network: PlaintextOpt = False,
    operator: OperatorOpt = None,
    remote_operator: RemoteOperatorOpt = False,
    enrolled: EnrolledOpt = None,
    auth: AuthOpt = None,
    workdir: Annotated[Path | None, typer.Option(help="Flower's files (default: OUTPUT_DIR/flower).")] = None,  # noqa: UP007
    max_wait: Annotated[
        float,
        typer.Option(
            min=1,
            help="With --superlink: seconds to wait for it to answer (it may still be starting) before "
            "giving up with the reason.",
        ),
    ] = 60,
) -> None:
    """Run the experiment over Flower and follow it until its last round; results land in
    the config's output_dir as with ``fedpeft run``. Clients join with ``fedpeft join`` and
    receive the config from here. Without --superlink a SuperLink is started for this run
    and stopped after it; with --superlink the run goes to a long-lived one. Stopped
    (Ctrl-C, SIGTERM, SIGHUP, its shell gone), it stops the run and everything it started;
    --resume continues the run."""
    from fedpeft.flower import deploy
    from fedpeft.flower.connect import local_address, wait_for_superlink
    from fedpeft.flower.processes import CommandProcesses, Stopped

    try:
        cfg = read_config(config, set_)
        deploy.check_deployable(cfg)
    except ConfigError as err:
        fail(err)
    if superlink is not None and (cert is not None or key is not None):
        fail(
            ValueError("--cert/--key: for the SuperLink serve starts itself; with --superlink give --ca only")
        )
    tls = tls_setting(ca, insecure, cert, key, operator)
    if superlink is not None and (enrolled is not None or auth is not None or remote_operator):
        fail(
            ValueError(
                "--enrolled/--auth/--remote-operator: for the SuperLink serve starts itself; a running one "
                "has its own"
            )
        )
    if superlink is not None:
        from fedpeft.flower.connect import split_address

        try:
            plaintext_check(insecure, split_address(superlink)[0], plaintext_on_network, "--superlink")
        except deploy.DeployError as err:
            fail(err)
    else:
        plaintext_check(insecure, host, plaintext_on_network, "--host")
    authenticate = _auth(auth, tls, enrolled) if superlink is None else False
    work = (workdir or Path(cfg.output_dir) / "flower").resolve()
    link = None
    try:
        with CommandProcesses():  # on leaving, however: no process it started is left
            try:
                if superlink is None:
                    link = deploy.start_superlink(  # for this run only: its state in memory
                        work, host, port, tls, log=work / "superlink.log", auth=authenticate,
                        persistent=False, remote_operator=remote_operator,
                    )  # fmt: skip
                    superlink = local_address(host, port, tls)
                    if authenticate:
                        _enrol_folder(superlink, enrolled, tls, work)
                    log = work / "superlink.log"
                    common.console.print(
                        f"SuperLink on {host}:{port} for this run (log: {log})", soft_wrap=True
                    )
                    hint = _join_hint(_public_address(host, port), ca, authenticate)
                    common.console.print(f"clients join with: {hint}", soft_wrap=True)
                else:
                    wait_for_superlink(superlink, tls, max_wait=max_wait, say=_say("fedpeft serve"))
                # its own SuperLink, stopped, ends the run; a long-lived one is asked to
                status = deploy.submit(
                    cfg, superlink, workdir=work, tls=tls, resume=resume, resume_from=resume_from,
                    stop_if_interrupted=link is None,
                )  # fmt: skip
            except deploy.DeployError as err:
                fail(err)
            finally:
                if link is not None:
                    deploy.stop(link)
                    common.console.print(
                        "SuperLink stopped. Nodes wait up to their --max-wait for the next `fedpeft serve` "
                        "on this port; for several runs keep one up with `fedpeft superlink` and use "
                        "`serve --superlink`.",
                        soft_wrap=True,
                    )
    except Stopped as stop:
        _serve_stopped(stop, cfg)
    traffic = status.get("network-traffic", {})
    megabytes = traffic.get("total-bytes", 0) / 1e6
    common.console.print(f"run {status['run-id']}: {status['status']}, {megabytes:.2f} MB on the wire")
    from fedpeft.report.results import read_summary

    print_summaries([read_summary(Path(cfg.output_dir))])


@app.command()
def superlink(
    host: HostOpt = "0.0.0.0",
    port: PortOpt = 9092,
    ca: CaOpt = None,
    cert: CertOpt = None,
    key: KeyOpt = None,
    insecure: InsecureOpt = False,
    plaintext_on_network: PlaintextOpt = False,
    operator: OperatorOpt = None,
    remote_operator: RemoteOperatorOpt = False,
    enrolled: EnrolledOpt = None,
    auth: AuthOpt = None,
    workdir: Annotated[Path, typer.Option(help="The SuperLink's files (database, log).")] = Path(
        "runs/superlink"
    ),
) -> None:
    """Run a long-lived SuperLink until stopped (Ctrl-C): nodes join it once and take part in
    every run submitted with ``fedpeft serve CONFIG --superlink HOST:PORT``. With TLS only
    enrolled nodes join (``--enrolled`` at start, ``fedpeft enrol`` while it runs). Stopped
    (Ctrl-C, SIGTERM, SIGHUP, its shell gone), it ends the SuperLink and everything it
    started, the runs' ServerApps too. Its Control API (enrol, revoke, runs) answers the
    operator alone: from this machine, and with TLS only with the operator's credential
    (--operator; --remote-operator: from other machines too)."""
    from fedpeft.flower import deploy
    from fedpeft.flower.connect import local_address
    from fedpeft.flower.processes import CommandProcesses, Stopped

    tls = tls_setting(ca, insecure, cert, key, operator)
    plaintext_check(insecure, host, plaintext_on_network, "--host")
    if remote_operator and tls is None:
        fail(ValueError("--remote-operator: the operator's credential needs TLS (--ca, --cert, --key)"))
    authenticate = _auth(auth, tls, enrolled)
    work = workdir.resolve()
    try:
        with CommandProcesses():  # on leaving, however: no process it started is left
            try:
                link = deploy.start_superlink(
                    work, host, port, tls, log=work / "superlink.log", auth=authenticate,
                    remote_operator=remote_operator,
                )  # fmt: skip
                if authenticate:
                    _enrol_folder(local_address(host, port, tls), enrolled, tls, work)
            except deploy.DeployError as err:
                fail(err)
            address = _public_address(host, port)
            common.console.print(
                f"SuperLink listening on {host}:{port} until stopped (log: {work / 'superlink.log'})",
                soft_wrap=True,
            )
            common.console.print(
                f"clients join with: {_join_hint(address, ca, authenticate)}", soft_wrap=True
            )
            security = f"--ca {ca}" if ca is not None else "--insecure"
            common.console.print(
                f"runs start with: fedpeft serve CONFIG --superlink {address} {security}", soft_wrap=True
            )
            code = link.wait()
    except Stopped:
        code = 0
    if code:
        fail(deploy.DeployError(f"flower-superlink exited with code {code} (log: {work / 'superlink.log'})"))
    common.console.print("SuperLink stopped")


@app.command()
def join(
    superlink: Annotated[str, typer.Option(help="The SuperLink's address, HOST:PORT.")],
    partition_id: Annotated[int, typer.Option(help="This client's id, 0 .. partition.num_clients-1.")],
    data_file: Annotated[
        Path | None,  # noqa: UP007
        typer.Option(
            help="This client's own data (CSV/TSV/JSONL/Parquet); default: partition "
            "PARTITION_ID of the experiment's corpus."
        ),
    ] = None,
    state_dir: Annotated[Path, typer.Option(help="Where this client keeps its state.")] = Path(
        ".fedpeft-node"
    ),
    port: Annotated[
        int | None,  # noqa: UP007
        typer.Option(help="Local port of this node's app runtime (default: a free one)."),
    ] = None,
    max_wait: Annotated[
        float,
        typer.Option(
            min=1,
            help="Seconds to wait for an unreachable SuperLink (at the start, or once lost) before "
            "giving up with the reason.",
        ),
    ] = 300,
    ca: CaOpt = None,
    insecure: InsecureOpt = False,
    plaintext_on_network: PlaintextOpt = False,
    key: Annotated[
        Path | None,  # noqa: UP007
        typer.Option(
            help="This node's private key (from `fedpeft certs --nodes N`), for a SuperLink that "
            "admits enrolled nodes only."
        ),  # fmt: skip
    ] = None,
) -> None:
    """Join a federation as one client, until stopped (Ctrl-C). The node receives the
    experiment's config from the server with each run, trains and evaluates on its own data,
    and keeps its personal state (never sent) in --state-dir, where its warm worker (the
    model, built once, and the data, across rounds and runs) logs to worker-N.log. It
    rejoins a restarted SuperLink, and gives up after --max-wait seconds without one,
    saying why. Stopped (Ctrl-C, SIGTERM, SIGHUP, its shell gone), it ends the node and
    everything it started, its worker too."""
    from fedpeft.flower import deploy
    from fedpeft.flower.connect import split_address
    from fedpeft.flower.join import run_node
    from fedpeft.flower.processes import CommandProcesses, Stopped

    tls = tls_setting(ca, insecure)
    if data_file is not None and not data_file.is_file():
        fail(FileNotFoundError(f"--data-file {data_file}: no such file"))
    if key is not None and not key.is_file():
        fail(FileNotFoundError(f"--key {key}: no such file"))
    try:
        plaintext_check(insecure, split_address(superlink)[0], plaintext_on_network, "--superlink")
    except deploy.DeployError as err:
        fail(err)
    state = state_dir.resolve()

    def command() -> list[str]:
        return deploy.supernode_command(
            superlink,
            partition_id,
            state,
            data_file=data_file,
            tls=tls,
            port=port or deploy.free_port(),
            key=key,
        )

    common.console.print(
        f"client {partition_id} joining {superlink} ({'TLS' if tls else 'no TLS'}); state in {state_dir}",
        soft_wrap=True,
    )
    try:
        with CommandProcesses():  # on leaving, however: no process it started is left
            try:
                run_node(
                    command,
                    deploy.flower_env(state / "flwr-home"),  # carries the processes' owner
                    superlink,
                    tls,
                    cid=partition_id,
                    max_wait=max_wait,
                    log_path=state / "supernode.log",
                    fixed_port=port,
                    say=_say("fedpeft join"),
                )
            except deploy.DeployError as err:
                fail(err)
    except Stopped as stop:
        common.console.print(f"client {partition_id}: stopped ({stop.name})")
