"""What composes with what, decided in one module: the rules as data, one function that reads them.

A rule pairs a setting a config asks for with what it does not go with: another setting
(a layer's requirement), a capability of the method (a feature of :data:`FEATURES` that
the method's class declares it refuses, in its ``refuses`` mapping: the methods'
capabilities are data on their classes, read by :func:`declined`), or an engine.
:func:`refusal` walks :data:`RULES` in order and returns the first one a config breaks, as
the one line a user reads, or None. Each rule says what it reads, and so where it is
checked (its ``stage``):

- ``config``: the config alone, refused as it validates (:class:`~fedpeft.config.ExperimentConfig`'s
  validator): every command that reads the config refuses it;
- ``method``: what the built method declares, refused at set-up before the method prepares
  the model (:func:`fedpeft.experiment.attach_method`: a simulation, its ranks, the deployed
  server, every node, a loaded export);
- ``set-up``: what the prepared method shares, refused at set-up
  (:func:`fedpeft.experiment.build`, for every engine);

and which engines it concerns (:data:`ENGINES`). A rule of one engine alone is refused by
that engine's set-up: the in-process engine's and its ranks' (:func:`fedpeft.experiment.make_engine`),
the deployment's (``FlowerServer``; its config rules also by ``fedpeft serve`` before
anything starts). A single section's ranges and counts are checked by its pydantic model.

``docs/composition.md`` holds :func:`markdown`'s tables, generated from this data
(``python scripts/composition_docs.py``; ``tests/test_composition.py`` keeps them in step).
The module imports neither torch nor a method: a method is read through its attributes
(``name``, ``refuses``, ``pooled``, ``shared_names``).
"""

from __future__ import annotations

import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

#: A :class:`fedpeft.config.ExperimentConfig`, read through its attributes: the module
#: imports nothing of fedpeft, so that the config's validator may call it.
ExperimentConfig = Any

# ---------------------------------------------------------------- the methods' capabilities

#: The tasks (``data.task``) a method may be defined for.
TASKS = ("classification", "causal_lm", "token_classification", "extractive_qa")

#: Everything a method's ``refuses`` may name: the layers around a method, two training
#: options and the tasks (docs/composition.md says what each stands for).
FEATURES = (
    "dora",
    "fp16",
    "server_step",
    "correction",
    "robust",
    "lossy_downlink",
    "user_dp",
    "local_dp",
    "secure_aggregation",
    "sample_dp",
    *TASKS,
)

#: An undeclared feature refused for the reason of another.
FALLS_BACK = {"correction": "server_step", "robust": "server_step", "user_dp": "robust"}

#: The reason for ``dora`` of a method that does not declare it.
DORA_UNDEFINED = "its own handling of LoRA's factors or adapters is not defined for DoRA's magnitudes"

#: The reason for ``server_step`` of a method that shares no tensors (nor declares it).
SHARES_NOTHING = "it shares no tensors for a server step to move"


def declined(method: Any, feature: str) -> str:
    """Why ``method`` (an instance, or a class where no instance is at hand) does not
    compose with ``feature`` (one of :data:`FEATURES`); "" when it does. A feature the
    method does not declare takes its default: :data:`FALLS_BACK`'s, DoRA is opt-in
    (declared ``""``), and the server step is refused by a method that shares nothing."""
    if feature not in FEATURES:
        raise KeyError(f"no feature {feature!r}; the features are {', '.join(FEATURES)}")
    declared = method.refuses
    if feature in declared:
        return declared[feature]
    if feature in FALLS_BACK:
        return declined(method, FALLS_BACK[feature])
    if feature == "dora":
        return DORA_UNDEFINED
    if feature == "server_step" and shares_nothing(method):
        return SHARES_NOTHING
    return ""


def shares_nothing(method: Any) -> bool:
    """Whether no tensors cross a network for the server to step: pooled training, or a
    (prepared) method without shared tensors."""
    return method.pooled or (not isinstance(method, type) and not method.shared_names)


# ---------------------------------------------------------------- the rules

#: The engines a rule may concern: the in-process simulation, its ``torch.distributed``
#: ranks, a Flower deployment.
ENGINES = ("simulation", "ranks", "deployment")
IN_PROCESS = ("simulation", "ranks")

#: Where a rule is checked, in the order set-up learns what they read.
STAGES = ("config", "method", "set-up")


@dataclass(frozen=True)
class Rule:
    """``setting`` (``asks``: whether a config asks for it) does not go with ``against``:
    a method that declines ``feature`` (a name of :data:`FEATURES`, or a function of the
    config giving one), or whatever ``clash`` finds in the config (and the method).
    ``says``: the refusal, a :meth:`str.format` template of ``cfg``, ``method``, ``why``
    (the method's reason), ``composes`` (the methods that take ``feature``) and ``head``
    (the method's first shared head tensor)."""

    name: str
    setting: str
    against: str
    says: str
    asks: Callable[[ExperimentConfig], bool]
    feature: str | Callable[[ExperimentConfig], str] | None = None
    clash: Callable[[ExperimentConfig, Any], bool] | None = None
    stage: str = "config"
    engines: tuple[str, ...] = ENGINES

    def feature_of(self, cfg: ExperimentConfig) -> str | None:
        return self.feature(cfg) if callable(self.feature) else self.feature


def _sample(cfg) -> bool:
    return cfg.privacy.mode == "sample"


def _noised(cfg) -> bool:  # user or local mode: the updates are clipped and noised after training
    return cfg.privacy.mode in ("user", "local")


def _secure(cfg) -> bool:
    return cfg.deploy.secure_aggregation


def _dora(cfg) -> bool:
    lora = getattr(cfg.method, "lora", None)
    return lora is not None and lora.use_dora


RULES: tuple[Rule, ...] = (
    # ---- the config alone
    Rule(
        "drift_task", "`eval.drift`", "a `data.task` other than classification",
        "eval.drift: client drift compares the logits of the classification head, and data.task "
        "{cfg.data.task} has none (use data.task classification)",
        asks=lambda cfg: cfg.eval.drift, clash=lambda cfg, m: cfg.data.task != "classification",
    ),
    Rule(
        "drift_silos", "`eval.drift`", "`data.silos`",
        "eval.drift: the probe batch comes from the global test set, which data.silos has not",
        asks=lambda cfg: cfg.eval.drift, clash=lambda cfg, m: cfg.data.silos is not None,
    ),
    Rule(
        "scaffold_optimizer", "`train.correction: scaffold`", "a `train.optimizer` other than sgd",
        "train.correction scaffold: train.optimizer is {cfg.train.optimizer}; SCAFFOLD's client control "
        "(x - y) / (K lr) is the mean of the local gradients only under plain SGD steps (Karimireddy et "
        "al. 2020, option II): set train.optimizer: sgd",
        asks=lambda cfg: cfg.train.correction == "scaffold",
        clash=lambda cfg, m: cfg.train.optimizer != "sgd",
    ),
    Rule(
        "scaffold_secure", "`train.correction: scaffold`", "`deploy.secure_aggregation`",
        "train.correction scaffold: deploy.secure_aggregation sums the model updates alone, not the "
        "clients' control updates SCAFFOLD's server needs; use one or the other",
        asks=lambda cfg: cfg.train.correction == "scaffold", clash=lambda cfg, m: _secure(cfg),
    ),
    Rule(
        "secure_uplink", "`deploy.secure_aggregation`", "a `comm.uplink` codec",
        "comm.uplink {cfg.comm.uplink.codec}: deploy.secure_aggregation quantises and masks the update "
        "itself (SecAgg+ sums integers); a compressed update's codes cannot be summed. Use one or the other",
        asks=_secure, clash=lambda cfg, m: cfg.comm.uplink.codec != "none",
    ),
    Rule(
        "sample_quantized", "`privacy.mode: sample`", "`model.quantization`",
        "privacy.mode sample: per-example gradients are a vmap over the rows, which model.quantization "
        "{cfg.model.quantization}'s kernels cannot run under; use user or local",
        asks=_sample, clash=lambda cfg, m: cfg.model.quantization != "none",
    ),
    Rule(
        "sample_checkpointing", "`privacy.mode: sample`", "`model.gradient_checkpointing`",
        "privacy.mode sample: per-example gradients are a vmap over the rows, which "
        "model.gradient_checkpointing cannot run under; turn one off",
        asks=_sample, clash=lambda cfg, m: cfg.model.gradient_checkpointing,
    ),
    Rule(
        "sample_causal_lm", "`privacy.mode: sample`", "`data.task: causal_lm`",
        "privacy.mode sample: not for data.task causal_lm yet (a batch's scored positions are counted "
        "over the batch, not per example); use privacy.mode user or local",
        asks=_sample, clash=lambda cfg, m: cfg.data.task == "causal_lm",
    ),
    Rule(
        "secure_robust", "`deploy.secure_aggregation`", "a `server.aggregation` other than mean",
        "server.aggregation {cfg.server.aggregation}: deploy.secure_aggregation hides the individual "
        "updates a robust rule reads; use one or the other",
        asks=_secure, clash=lambda cfg, m: cfg.server.aggregation != "mean",
    ),
    # ---- what the built method declares (before it prepares the model)
    Rule(
        "task", "a `data.task`", "a method that declines that task",
        "method.name {method.name}: not defined for data.task {cfg.data.task}; {why}",
        asks=lambda cfg: True, feature=lambda cfg: cfg.data.task, stage="method",
    ),
    Rule(
        "fp16", "`train.precision: fp16`", "",
        "train.precision: fp16 needs loss scaling, which method {method.name} ({why}) does not have; use "
        "bf16 (float32's range, no scaling needed) or fp32",
        asks=lambda cfg: cfg.train.precision == "fp16", feature="fp16", stage="method",
    ),
    Rule(
        "dora", "`method.lora.use_dora`", "",
        "method.lora.use_dora: not for method {method.name}: {why} (DoRA composes with {composes}: its "
        "magnitudes are trained tensors beside the factors)",
        asks=_dora, feature="dora", stage="method",
    ),
    # ---- what the prepared method shares
    Rule(
        "server_step", "a `server.optimizer` other than fedavg at `server.lr` 1", "",
        "server.optimizer {cfg.server.optimizer} (server.lr {cfg.server.rate:g}): method {method.name}: "
        "{why}",
        asks=lambda cfg: cfg.server.optimizer != "fedavg" or cfg.server.rate != 1.0,
        feature="server_step", stage="set-up",
    ),
    Rule(
        "robust", "a `server.aggregation` other than mean", "",
        "server.aggregation {cfg.server.aggregation}: method {method.name}: {why}",
        asks=lambda cfg: cfg.server.aggregation != "mean", feature="robust", stage="set-up",
    ),
    Rule(
        "prox", "`train.prox_mu` above 0", "a method that shares no tensors",
        "train.prox_mu {cfg.train.prox_mu:g}: method {method.name} shares no tensors to anchor",
        asks=lambda cfg: cfg.train.prox_mu > 0, clash=lambda cfg, m: shares_nothing(m), stage="set-up",
    ),
    Rule(
        "correction", "`train.correction: scaffold`", "",
        "train.correction scaffold: method {method.name}: {why}",
        asks=lambda cfg: cfg.train.correction == "scaffold", feature="correction", stage="set-up",
    ),
    Rule(
        "sample_dp", "`privacy.mode: sample`", "",
        "privacy.mode sample: method {method.name} {why}, and DP-SGD's accountant needs one batch a step "
        "drawn without replacement",
        asks=_sample, feature="sample_dp", stage="set-up",
    ),
    Rule(
        "user_dp", "`privacy.mode: user`", "",
        "privacy.mode user: method {method.name}: {why}; user-level DP noises only the sum of the updates, "
        "which this server does not take (privacy.mode local noises each update before it leaves)",
        asks=lambda cfg: cfg.privacy.mode == "user", feature="user_dp", stage="set-up",
    ),
    Rule(
        "local_dp", "`privacy.mode: local`", "",
        "privacy.mode local: method {method.name}: {why}",
        asks=lambda cfg: cfg.privacy.mode == "local", feature="local_dp", stage="set-up",
    ),
    Rule(
        "user_robust", "`privacy.mode: user`", "a `server.aggregation` other than mean",
        "privacy.mode user: server.aggregation {cfg.server.aggregation} reads the individual updates, and "
        "user-level DP adds its noise to their sum only; use aggregation mean (or privacy.mode local, whose "
        "updates leave the clients noised)",
        asks=lambda cfg: cfg.privacy.mode == "user", clash=lambda cfg, m: cfg.server.aggregation != "mean",
        stage="set-up",
    ),
    Rule(
        "noised_scaffold", "`privacy.mode: user` or `local`", "`train.correction: scaffold`",
        "privacy.mode: train.correction scaffold sends each client's control update beside its model "
        "update, and only the model update is clipped and noised; use one or the other",
        asks=_noised, clash=lambda cfg, m: cfg.train.correction == "scaffold", stage="set-up",
    ),
    Rule(
        "adaptive_clip_secure", "`privacy.adaptive_clip` (`privacy.mode: user` or `local`)",
        "`deploy.secure_aggregation`",
        "privacy.adaptive_clip: each client's report (within the bound or not) would reach the server in "
        "the clear beside SecAgg+'s masked sum; use a fixed privacy.clip with deploy.secure_aggregation",
        asks=lambda cfg: _noised(cfg) and cfg.privacy.adaptive_clip, clash=lambda cfg, m: _secure(cfg),
        stage="set-up",
    ),
    Rule(
        "lossy_downlink", "a lossy `comm.downlink` codec", "",
        "comm.downlink {cfg.comm.downlink.codec}: method {method.name}: {why}",
        asks=lambda cfg: cfg.comm.downlink.codec != "none", feature="lossy_downlink", stage="set-up",
    ),
    Rule(
        "silos_head", "`data.silos` (a label space each)", "a method that shares its classifier",
        "data.silos: method {method.name} would aggregate classifiers across tasks ({head}, ...); each silo "
        "has its own label space: set method.head: personal",
        asks=lambda cfg: cfg.data.silos is not None,
        clash=lambda cfg, m: any("head." in n for n in m.shared_names), stage="set-up",
    ),
    # ---- one engine's
    Rule(
        "faults_pooled", "`faults.byzantine_clients`", "a method that pools the data",
        "faults.byzantine_clients: method {method.name} pools the data; no client sends",
        asks=lambda cfg: cfg.faults.byzantine_clients > 0, clash=lambda cfg, m: m.pooled, stage="set-up",
        engines=IN_PROCESS,
    ),
    Rule(
        "deployed_faults", "`faults.byzantine_clients`", "a deployment",
        "faults.byzantine_clients: faulty clients are simulated by the in-process engine (`fedpeft run`); "
        "a deployed node runs its own code",
        asks=lambda cfg: cfg.faults.byzantine_clients > 0, clash=lambda cfg, m: True,
        engines=("deployment",),
    ),
    Rule(
        "deployed_drift", "`eval.drift`", "a deployment",
        "eval.drift: client drift is measured by the in-process engine (`fedpeft run`); a deployed server "
        "never holds a client's model after its round. Set eval.drift: false to deploy",
        asks=lambda cfg: cfg.eval.drift, clash=lambda cfg, m: True, engines=("deployment",),
    ),
    Rule(
        "deployed_pooled", "a method that pools the data (`pooled`)", "a deployment",
        "method {method.name!r} trains on all clients' data pooled in one place; it is a reference for "
        "simulations and cannot run across machines",
        asks=lambda cfg: True, clash=lambda cfg, m: m.pooled, stage="set-up", engines=("deployment",),
    ),
    Rule(
        "deployed_personal", "`export.personal`", "a deployment",
        "export.personal: in a deployment each client's personal state stays on its node, so the server "
        "cannot export clients' models; export them in a simulation (fedpeft run)",
        asks=lambda cfg: cfg.export.personal, clash=lambda cfg, m: True, stage="set-up",
        engines=("deployment",),
    ),
    Rule(
        "secure_method", "`deploy.secure_aggregation`", "",
        "deploy.secure_aggregation: method {method.name!r} does not aggregate by the example-weighted mean "
        "of the updates, which is all SecAgg+ can compute",
        asks=_secure, feature="secure_aggregation", stage="set-up", engines=("deployment",),
    ),
    Rule(
        "secure_cohort", "`deploy.secure_aggregation`", "`train.clients_per_round` below 2",
        "deploy.secure_aggregation needs train.clients_per_round >= 2",
        asks=_secure, clash=lambda cfg, m: cfg.train.clients_per_round < 2, stage="set-up",
        engines=("deployment",),
    ),
    Rule(
        "secure_weight_share", "`deploy.secure_aggregation`", "`deploy.max_weight_share` below 1",
        "deploy.max_weight_share {cfg.deploy.max_weight_share:g}: under deploy.secure_aggregation each "
        "client weighs its own masked update, which the server cannot reweigh; use deploy.max_weight_share 1 "
        "(a weight is still bounded by its roll call)",
        asks=_secure, clash=lambda cfg, m: cfg.deploy.max_weight_share < 1, stage="set-up",
        engines=("deployment",),
    ),
)  # fmt: skip


class _Facts(dict):
    """What a refusal's template may name, each computed when it does."""

    def __init__(self, cfg, method, why: str, feature: str | None, methods: Mapping[str, Any] | None):
        super().__init__(cfg=cfg, method=method, why=why)
        self.feature, self.methods = feature, methods or {}

    def __missing__(self, key: str) -> str:
        if key == "composes":
            return ", ".join(n for n, cls in self.methods.items() if not declined(cls, self.feature))
        if key == "head":
            return next(n for n in self["method"].shared_names if "head." in n)
        raise KeyError(key)


def broken(rule: Rule, cfg: ExperimentConfig, method: Any = None, methods: Mapping | None = None) -> str:
    """``rule``'s refusal of ``cfg`` (and ``method``); "" when it holds."""
    if not rule.asks(cfg):
        return ""
    feature, why = rule.feature_of(cfg), ""
    if feature is not None:
        if not (why := declined(method, feature)):
            return ""
    elif not rule.clash(cfg, method):
        return ""
    return rule.says.format_map(_Facts(cfg, method, why, feature, methods))


def refusal(
    cfg: ExperimentConfig,
    method: Any = None,
    *,
    engine: str | None = None,
    stage: str | None = None,
    methods: Mapping[str, Any] | None = None,
) -> str | None:
    """The one line refusing ``cfg``, or None: the first rule of :data:`RULES` it breaks
    among those of ``engine`` (None: those every engine shares) and of the stages up to
    ``stage`` (by default ``set-up`` given a method, else ``config``). ``method``: the
    built method (prepared on its model at ``set-up``); ``methods``: the registered
    methods by name, which a refusal may name as those that compose."""
    upto = STAGES.index(stage or ("config" if method is None else "set-up"))
    for rule in RULES:
        concerns = engine in rule.engines if engine else rule.engines == ENGINES
        if STAGES.index(rule.stage) > upto or not concerns:
            continue
        if says := broken(rule, cfg, method, methods):
            return says
    return None


# ---------------------------------------------------------------- the documentation

STAGE_WORDS = {
    "config": "as the config is read",
    "method": "at set-up, before the method prepares the model",
    "set-up": "at set-up",
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def rules_table() -> str:
    """:data:`RULES` as a markdown table, in the order they are checked."""
    rows = [
        "| Rule | The config asks for | Refused with | Checked | Engines |",
        "|---|---|---|---|---|",
    ]
    for rule in RULES:
        feature = rule.feature if isinstance(rule.feature, str) else None
        against = rule.against or f"a method that declines `{feature}`"
        engines = "all" if rule.engines == ENGINES else ", ".join(rule.engines)
        rows.append(
            f"| `{rule.name}` | {_cell(rule.setting)} | {_cell(against)} | {STAGE_WORDS[rule.stage]} | "
            f"{engines} |"
        )
    return "\n".join(rows)


def methods_table(methods: Mapping[str, Any]) -> str:
    """Which :data:`FEATURES` each class of ``methods`` (by name) declines (x) or takes
    (.), as its class declares: a feature a prepared method's config or tensors decline
    (FDLoRA's ``global_init``, a method that ends up sharing nothing) may differ."""
    rows = [
        "| Method | " + " | ".join(f"`{f}`" for f in FEATURES) + " |",
        "|---|" + "---|" * len(FEATURES),
    ]
    for name, cls in methods.items():
        rows.append(f"| `{name}` | " + " | ".join("x" if declined(cls, f) else "." for f in FEATURES) + " |")
    return "\n".join(rows)


def markdown(methods: Mapping[str, Any]) -> str:
    """The generated part of docs/composition.md."""
    legend = "Each method's class as it declares: x, it declines the feature; ., it takes it."
    return (
        f"## The rules\n\n{rules_table()}\n\n## The methods' capabilities\n\n{legend}\n\n"
        f"{methods_table(methods)}\n"
    )


def template_words(rule: Rule) -> str:
    """The longest literal run of ``rule``'s refusal: words written in this module alone."""
    return max((text for text, *_ in string.Formatter().parse(rule.says)), key=len).strip()
