"""Assemble and run one experiment: config -> data -> partition -> model + method -> engine -> results.

This is the recipe layer (the engines and methods are the building blocks); the CLI's
``run`` and ``partition`` commands are thin wrappers over it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from fedpeft.composition import refusal
from fedpeft.config import ConfigError, ExperimentConfig, TrainConfig, dump_config, public_config
from fedpeft.config.secrets import identity_dump
from fedpeft.data import partition as P
from fedpeft.data.encoding import encode_corpus
from fedpeft.data.silos import load_silos
from fedpeft.data.sources import Corpus, load_corpus
from fedpeft.data.split import Clients, Split, make_split
from fedpeft.data.task import Encoded
from fedpeft.engines import privacy
from fedpeft.engines.checkpoint import STORE_DIR, Checkpoints, ResumeError
from fedpeft.engines.distributed import Ranks, joined
from fedpeft.engines.faults import faulty_clients, flip_labels
from fedpeft.engines.guard import DivergedError, nonfinite_tensor
from fedpeft.engines.inprocess import InProcessEngine, RunPlan
from fedpeft.engines.local import cohort_mode, enable_checkpointing
from fedpeft.engines.robust import combiner
from fedpeft.engines.store import ClientStore
from fedpeft.methods import build_method
from fedpeft.methods.base import ClientData, Method, ServerState, Tensors, load_tensors, read_tensors
from fedpeft.metrics.scorers import scorer_for
from fedpeft.metrics.variation import lora_variations
from fedpeft.models.backbone import TaskModel, build_model, resolve_backbone
from fedpeft.models.device import autocast_dtype, resolve_device
from fedpeft.optional import bitsandbytes_unless, uses_bitsandbytes
from fedpeft.report import results as R
from fedpeft.report.tracking import Tracking


def fingerprint(cfg: ExperimentConfig) -> str:
    """A hash of everything that determines the results (output_dir, export, checkpoint, log,
    and train.device, train.cohort_size, train.cohort_mode, train.compile, train.client_memory_mb,
    train.memory_check, train.on_corrupt_state and deploy.warm_nodes, with which a run may
    resume differently laid out):
    the settings that differ
    from their defaults, and the method's name. An option that a later fedpeft adds, with
    a default, leaves it unchanged, so older runs still resume. No secret enters it
    (:func:`fedpeft.config.secrets.identity_dump`): a run whose credential moved from the
    config to the environment, or was redacted in the config.yaml it resumes from, is the same run."""
    exclude = {
        "output_dir": True,
        "export": True,
        "checkpoint": True,
        "log": True,
        "train": {
            "device",
            "cohort_size",
            "cohort_mode",
            "compile",
            "client_memory_mb",
            "memory_check",
            "on_corrupt_state",
        },
        "deploy": {"warm_nodes"},
    }
    data = identity_dump(cfg, exclude_defaults=True, exclude=exclude)  # no credential in it
    data["method"] = {**data.get("method", {}), "name": cfg.method.name}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def param_counts(model: TaskModel, method: Method) -> dict[str, int]:
    params = dict(model.named_parameters())
    count = lambda names: sum(params[n].numel() for n in names)  # noqa: E731
    return {
        "total": sum(p.numel() for p in params.values()),
        "trainable": sum(p.numel() for p in params.values() if p.requires_grad),
        "shared": count(method.shared_names),
        "personal": count(method.personal_names),
    }


@dataclass
class Setup:
    """Everything built from a config, ready for an engine."""

    cfg: ExperimentConfig
    corpus: Corpus
    split: Split
    model: TaskModel
    method: Method
    clients: Sequence[ClientData]  # Clients: made when asked for
    global_test: Encoded
    initial: Tensors  # the trainable tensors right after prepare(), restored by every run
    tokenizer: object = None  # what generation decodes with (causal_lm)


def build(cfg: ExperimentConfig, model: TaskModel | None = None, tokenizer=None) -> Setup:
    """Data, partition, model and method for ``cfg`` (a given model/tokenizer is reused)."""
    with bitsandbytes_unless(uses_bitsandbytes(cfg)):
        return _build(cfg, model, tokenizer)


def _build(cfg: ExperimentConfig, model: TaskModel | None, tokenizer) -> Setup:
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    corpus = load_silos(cfg.data, cfg.seed) if cfg.data.silos else load_corpus(cfg.data, cfg.seed)
    split = make_split(cfg, corpus)
    if model is None:
        outputs = len(corpus.tag_names) if corpus.tag_names is not None else corpus.num_classes  # QA: unused
        device = str(resolve_device(cfg.train.device))  # a quantised backbone loads in place
        model, tokenizer = build_model(cfg.model, outputs, cfg.seed, cfg.data.task, device)
    pool, global_test = encode_corpus(corpus, tokenizer, cfg.data)
    method, initial = attach_method(cfg, model)
    if why := refusal(cfg, method):  # what the prepared method composes with, for every engine
        raise ConfigError(why)
    device = place(model, cfg.train)
    if cfg.model.gradient_checkpointing:
        enable_checkpointing(model)
    pool, global_test = pool.to(device), global_test.to(device)
    clients = Clients(pool, split, corpus.label_spaces)
    return Setup(cfg, corpus, split, model, method, clients, global_test, initial, tokenizer)


def attach_method(cfg: ExperimentConfig, model: TaskModel) -> tuple[Method, Tensors]:
    """Build the configured method and let it prepare ``model`` (seeded, so every process
    that builds the same config holds the same initial adapters); returns the method and
    the trainable tensors right after preparation. Its server combines uplinks by
    ``server.aggregation``'s rule where it takes their mean."""
    method = build_method(cfg.method, cfg.train, cfg.seed, mean=combiner(cfg.server))
    from fedpeft.methods import REGISTRY  # the methods a refusal names as those that compose

    if why := refusal(cfg, method, stage="method", methods=REGISTRY):  # before it prepares the model
        raise ConfigError(why)
    check_dora_caching(cfg)
    torch.manual_seed(cfg.seed + 1)  # adapter / LoRA initialisation
    method.prepare(model)
    half = {id(p) for p in half_precision_tensors(model)}
    for p in model.parameters():  # trained in float32 whatever the backbone's dtype (model.dtype)
        if p.is_floating_point() and id(p) not in half and p.dtype != torch.float32:
            p.data = p.data.float()
    initial = read_tensors(model, [n for n, p in model.named_parameters() if p.requires_grad])
    return method, initial


def check_dora_caching(cfg: ExperimentConfig) -> None:
    """A :class:`ConfigError` when ``method.lora.use_dora`` is set while HF PEFT caches
    DoRA's norms (the cache would hand one client's norm to the next, in the one shared model)."""
    lora = getattr(cfg.method, "lora", None)
    if lora is None or not lora.use_dora:
        return
    from peft.tuners.lora import dora

    if dora.ENABLE_DORA_CACHING:
        raise ConfigError(
            "method.lora.use_dora: peft.tuners.lora.dora.ENABLE_DORA_CACHING is on; its cached norms would "
            "be shared by the clients of the one model: turn it off"
        )


def stored_precision(model: TaskModel) -> torch.dtype | None:
    """The autocast precision of a backbone stored in half precision (``model.dtype:
    bfloat16``), whose frozen layers then compute in it beside the float32 trained tensors;
    None for a float32 one."""
    half = {p.dtype for p in half_precision_tensors(model)} & {torch.bfloat16, torch.float16}
    return half.pop() if len(half) == 1 else None


def place(model: TaskModel, train: TrainConfig) -> torch.device:
    """Move ``model`` (prepared: its adapters added) to ``train.device`` and set its
    autocast precision; returns the device, where the clients' data must go too. In
    bf16/fp16 the frozen weights are stored in that dtype (nothing updates them, so they
    need no float32 master copy; half the memory, and a vmapped linear layer with a
    bias computes in that dtype only when its weights are in it)."""
    device = resolve_device(train.device)
    model.to(device)
    model.precision = autocast_dtype(train.precision) or stored_precision(model)
    if model.precision is not None:
        for p in half_precision_tensors(model):
            p.data = p.data.to(model.precision)
    return device


def half_precision_tensors(model: torch.nn.Module) -> Iterator[torch.nn.Parameter]:
    """The frozen float tensors a half-precision run stores in its precision: all but those
    of a layer norm that trains some of its own (BitFit trains a norm's bias alone, and the
    CPU kernels want its weight and bias in one dtype), which stay float32 whole."""
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if isinstance(module, torch.nn.LayerNorm) and any(p.requires_grad for p in own):
            continue
        yield from (p for p in own if not p.requires_grad and p.is_floating_point())


def pooled_schedule(setup: Setup) -> tuple[list[ClientData], int]:
    """Centralized: one client holding all training data; steps matching a federated round."""
    cfg, clients = setup.cfg, setup.clients
    pooled = ClientData(
        0, Encoded.concat([c.train for c in clients]), Encoded.concat([c.test for c in clients])
    )
    if cfg.train.local_steps:
        steps = cfg.train.local_steps * cfg.train.clients_per_round
    else:
        per_client = [
            cfg.train.local_epochs * math.ceil(len(c.train) / cfg.train.batch_size) for c in clients
        ]
        steps = max(1, round(np.mean(per_client) * cfg.train.clients_per_round))
    return [pooled], steps


def cohort_size(cfg: ExperimentConfig, method: Method, model: torch.nn.Module) -> int | None:
    """``train.cohort_size`` as the engine takes it (None: probe the device), refused here
    when the cohort cannot train as asked (:func:`fedpeft.engines.local.cohort_mode`: a
    quantised or checkpointed backbone's cohorts fold, and a method that cannot fold then
    trains one client at a time)."""
    size = cfg.train.cohort_size
    dp_sgd = cfg.privacy.mode == "sample"
    mode = cohort_mode(method, model, cfg.train.cohort_mode, dp_sgd, compiled=cfg.train.compile)
    if mode.how != "alone":
        return None if size == "auto" else size
    if size not in ("auto", 1):
        raise ConfigError(
            f"train.cohort_size {size}: {mode.why}; use cohort_size 1 or auto (one client at a time)"
        )
    return 1


def make_engine(
    setup: Setup,
    on_round: Callable[[dict], None] | None,
    say: Callable[[str], None] | None = None,
    tracking: Tracking | None = None,
    ranks: Ranks | None = None,
) -> InProcessEngine:
    """The in-process engine for ``setup``, writing ``metrics.jsonl`` (and ``tracking``'s
    trackers) as rounds complete; over ``ranks``, rank 0 alone writes."""
    cfg, out = setup.cfg, Path(setup.cfg.output_dir)
    leader = ranks is None or ranks.leader
    clients, per_round = setup.clients, cfg.train.clients_per_round
    faulty = faulty_clients(cfg.faults, cfg.seed, len(clients))
    if why := refusal(cfg, setup.method, engine="simulation" if ranks is None else "ranks"):
        raise ConfigError(why)
    if cfg.faults.attack == "label_flip":  # the faulty clients train on flipped labels from the start
        flip = lambda c: replace(c, train=flip_labels(c.train, setup.corpus.num_classes))  # noqa: E731
        clients = clients.altering(dict.fromkeys(faulty, flip))  # the setup's own stay as they are
    train = cfg.train
    if setup.method.pooled:
        clients, steps = pooled_schedule(setup)
        train, per_round = cfg.train.model_copy(update={"local_steps": steps}), 1
    plan = RunPlan(
        rounds=cfg.train.rounds,
        clients_per_round=per_round,
        seed=cfg.seed,
        eval_every=cfg.eval.every,
        eval_local=cfg.eval.local,
        eval_batch_size=cfg.eval.batch_size,
        cohort_size=cohort_size(cfg, setup.method, setup.model),
        per_client_scores=cfg.data.silos is not None,
        drift_probe=cfg.eval.drift_probe if cfg.eval.drift else 0,
        poisson=cfg.train.client_sampling == "poisson",
        min_results=cfg.deploy.min_results,
        max_skipped_rounds=cfg.deploy.max_skipped_rounds,
    )
    metrics_path = out / "metrics.jsonl"

    def record_round(record: dict) -> None:
        R.append_record(metrics_path, record)
        if tracking:
            tracking.round(record)
        if on_round:
            on_round(record)

    def start(done: list[dict]) -> None:
        # metrics.jsonl restarts from the checkpoint's records (or empty): nothing lost, nothing twice
        R.write_records(metrics_path, done)
        if tracking:
            tracking.start(done)

    return InProcessEngine(
        setup.model,
        setup.method,
        clients,
        setup.global_test,
        plan,
        eval_clients=setup.clients,
        checkpoints=checkpoints(cfg, say),
        fingerprint=fingerprint(cfg),
        on_round=record_round if leader else None,
        on_start=start if leader else None,
        analyzers=update_variation_analyzers(setup.method),
        store=client_store(cfg, shared=ranks is not None),
        scorer=scorer_for(cfg.data.task, setup.tokenizer, cfg.eval, setup.corpus),
        on_corrupt_state=cfg.train.on_corrupt_state,
        train=train,
        memory_check=cfg.train.memory_check,
        server=cfg.server,
        faults=cfg.faults,
        faulty=faulty,
        comm=cfg.comm,
        privacy_cfg=cfg.privacy,
        ranks=ranks,
    )


def checkpoints(cfg: ExperimentConfig, say: Callable[[str], None] | None = None) -> Checkpoints | None:
    """The run's kept checkpoints (``output_dir/checkpoint.pt`` and earlier rounds beside it)."""
    if not cfg.checkpoint.enabled:
        return None
    return Checkpoints(Path(cfg.output_dir) / "checkpoint.pt", cfg.checkpoint.keep, say)


def client_store(cfg: ExperimentConfig, shared: bool = False) -> ClientStore:
    """The clients' personal states: in memory within ``train.client_memory_mb``, spilled
    to ``output_dir/clients/``, where checkpoints keep them too (and, ``shared``, where the
    ranks of a run hand them on). Where it goes: the engine opens it, with its index, as
    the run starts (fresh or from a checkpoint)."""
    budget = None if cfg.train.client_memory_mb is None else int(cfg.train.client_memory_mb * 2**20)
    needs_files = cfg.checkpoint.enabled or budget is not None or shared
    return ClientStore(Path(cfg.output_dir) / STORE_DIR if needs_files else None, budget, durable=False)


def update_variation_analyzers(method: Method) -> dict:
    """Per-round update variation of the global LoRA matrices, when the method shares any."""
    return {"update_variation": lora_variations} if any("lora_" in n for n in method.shared_names) else {}


def export(
    setup: Setup,
    server_tensors: Tensors,
    out: Path,
    client_models: Callable[[ClientData], Tensors] | None = None,
) -> dict | None:
    """Save the global model under ``out/adapter`` (its shared tensors only: personal state
    never enters the global export) and, given ``client_models`` (in-process runs with
    ``export.personal``), each client's own model under ``out/adapter/clients/<cid>``.
    Every directory gets ``fedpeft_model.json``: the task, backbone and method; for
    classification the pooling and label names; for a causal LM the system prompt its
    training used; which model it is (``part``: ``global`` or ``client``, and ``client``,
    its id); and the run's resolved ``config`` (its secrets redacted), from which
    :func:`fedpeft.load_export` rebuilds the model, so that a directory loads on its own,
    wherever it is copied."""
    target = out / "adapter"
    shutil.rmtree(target, ignore_errors=True)  # never leave a previous run's adapter behind
    method, exported, cfg = setup.method, {}, setup.cfg
    info: dict = {"task": cfg.data.task, "backbone": cfg.model.backbone, "method": method.name}
    if cfg.model.quantization != "none":  # the base it loads onto is quantised the same way
        info["quantization"] = cfg.model.quantization
    if cfg.data.task == "causal_lm":
        info["gguf_file"] = resolve_backbone(cfg.model)[1]
        info["system_prompt"] = cfg.data.system_prompt
    elif cfg.data.task == "extractive_qa":  # each token's (start, end) logits
        info["outputs"] = ["start", "end"]
    elif cfg.data.task == "token_classification":  # a tag per token, no pooling
        info["id2label"] = dict(enumerate(setup.corpus.tag_names))
    else:
        info.update(pooling=cfg.model.pooling, id2label=dict(enumerate(setup.corpus.class_names)))
    config = {"config": public_config(cfg)}  # its secrets redacted
    if method.shared_names:
        shared = {n: server_tensors[n] for n in method.global_export_names()}
        refuse_nonfinite(shared, target)
        exported["global"] = str(method.export(setup.model, shared, target))
        R.write_json(target / "fedpeft_model.json", {**info, "part": "global", **config})
    if client_models is not None and setup.cfg.export.personal:
        for client in setup.clients:
            client_dir = target / "clients" / str(client.cid)
            tensors = client_models(client)
            refuse_nonfinite(tensors, client_dir)
            method.export(setup.model, tensors, client_dir)
            client_info = {**info, "part": "client", "client": client.cid, **config}
            R.write_json(client_dir / "fedpeft_model.json", client_info)
        exported["clients"] = str(target / "clients")
    return exported or None


def refuse_nonfinite(tensors: Tensors, target: Path) -> None:
    if (name := nonfinite_tensor(tensors)) is not None:
        raise ValueError(f"{target}: refusing to export tensor {name!r}: it is not finite")


def run(
    cfg: ExperimentConfig,
    resume: bool = False,
    on_round: Callable[[dict], None] | None = None,
    setup: Setup | None = None,
    resume_from: int | None = None,
    say: Callable[[str], None] | None = None,
) -> dict:
    """Run ``cfg`` end to end and write its output directory; returns the summary.
    ``resume``: continue from the newest readable checkpoint (``resume_from``: round
    ``resume_from``'s); ``say``: where the run reports what a user must know (a checkpoint
    it skipped). A run that diverges raises :class:`DivergedError` after exporting its last
    good global model."""
    with bitsandbytes_unless(uses_bitsandbytes(cfg)):
        return _run(cfg, resume, on_round, setup, resume_from, say)


def _run(
    cfg: ExperimentConfig,
    resume: bool,
    on_round: Callable[[dict], None] | None,
    setup: Setup | None,
    resume_from: int | None,
    say: Callable[[str], None] | None,
) -> dict:
    resume = resume or resume_from is not None
    if resume and not cfg.checkpoint.enabled:
        raise ResumeError("--resume needs checkpoints, but the config sets checkpoint: false")
    t_setup = time.perf_counter()
    ranks = joined()  # several processes share the rounds (torchrun); rank 0 alone writes
    leader = ranks is None or ranks.leader
    tracking = Tracking(cfg, resume) if leader else None  # a tracker's missing package fails first
    setup = setup or build(cfg)
    load_tensors(setup.model, setup.initial)  # a setup may serve several runs
    hist = open_output(setup) if leader else None
    with tracking or contextlib.nullcontext():
        engine = make_engine(setup, on_round, say, tracking, ranks)
        t_run = time.perf_counter()
        try:
            records = engine.run(resume=resume, resume_from=resume_from)
        except DivergedError as err:
            if err.round > 1 and leader:  # the last good global model (none was trained before round 1)
                export(setup, err.last_good.tensors, Path(cfg.output_dir))
            raise
        t_end = time.perf_counter()
        if not leader:
            return {"rank": ranks.rank, "rounds": len(records)}
        device = str(next(setup.model.parameters()).device)
        extra = {"time_setup": t_run - t_setup, "time_total": t_end - t_setup, "device": device}
        client_models = lambda client: engine.client_model(engine.server, client)[0]  # noqa: E731
        return finish(setup, records, engine.server, hist, extra, client_models)


def open_output(setup: Setup) -> np.ndarray:
    """Create the output directory with the config and the partition heatmap; returns the
    clients' label histograms."""
    cfg = setup.cfg
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(dump_config(cfg))
    hist = setup.split.histograms(setup.corpus.train_labels, setup.corpus.num_classes)
    if cfg.log.plots:
        P.plot_label_heatmap(hist, out / "partition_heatmap.png", setup.corpus.class_names, cfg.name)
    return hist


def client_groups(setup: Setup) -> dict[str, list[int]]:
    """``partition.scheme: groups``: the clients of each value of the group column."""
    split = setup.split
    parts = [np.concatenate([a, b]) for a, b in zip(split.train, split.test, strict=True)]
    out: dict[str, list[int]] = {}
    for cid, value in enumerate(P.client_groups(setup.corpus.train_groups, parts)):
        out.setdefault(str(value), []).append(cid)
    return out


def finish(
    setup: Setup,
    records: list[dict],
    server: ServerState,
    hist: np.ndarray,
    extra: dict,
    client_models: Callable[[ClientData], Tensors] | None = None,
) -> dict:
    """Write ``summary.json``, the exported adapters and the plots (``log.plots``); returns
    the summary."""

    cfg, out = setup.cfg, Path(setup.cfg.output_dir)
    summary = R.summarize(
        records,
        {
            "name": cfg.name,
            "method": cfg.method.name,
            "seed": cfg.seed,
            "num_clients": cfg.partition.num_clients,
            "clients_per_round": cfg.train.clients_per_round,
            "partition": cfg.partition.scheme,
            "mean_pairwise_js": P.mean_pairwise_js(hist),
            **({"client_groups": client_groups(setup)} if cfg.partition.scheme == "groups" else {}),
            "class_names": setup.corpus.class_names,
            "params": param_counts(setup.model, setup.method),
            "communicated_params_per_client": sum(
                t.numel() for t in setup.method.downlink(server, 0).values()
            ),
            **extra,
            **({"privacy": privacy.summary(cfg.privacy, records)} if cfg.privacy.mode != "none" else {}),
            "exported": export(setup, server.tensors, out, client_models),
        },
    )
    R.write_json(out / "summary.json", summary)
    if cfg.log.plots:
        from fedpeft.report import plots  # slow import: matplotlib

        plots.plot_accuracy({cfg.name: records}, out)
        plots.plot_variation({cfg.name: records}, out)
        plots.plot_readouts(records, out)
        plots.plot_drift({cfg.name: records}, out)
    return summary
