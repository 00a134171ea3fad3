"""What composes with what (:mod:`fedpeft.composition`): every rule refuses, word for word,
a config that breaks it and nothing else; where each is checked; and docs/composition.md
holds the tables its data makes. That the rules are decided there alone:
``tests/test_layout.py::test_what_composes_with_what_is_decided_in_one_module``."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from fedpeft import composition as C
from fedpeft.config import ConfigError, parse_config

ROOT = Path(__file__).resolve().parents[1]
BASE = parse_config({"train": {"clients_per_round": 4}})  # breaks no rule


def varied(cfg, **settings):
    """``cfg`` with dotted ``settings`` (``server__optimizer`` for ``server.optimizer``) set,
    unvalidated: a config that a rule of the config alone refuses cannot be parsed."""
    for dotted, value in settings.items():
        *path, key = dotted.split("__")
        sections = [cfg]
        for name in path:
            sections.append(getattr(sections[-1], name))
        new = value
        for section, name in zip(reversed(sections), reversed([*path, key]), strict=True):
            new = section.model_copy(update={name: new})
        cfg = new
    return cfg


def method(refuses=None, pooled=False, shared=("lora.A",), name="m"):
    """A method as the rules read it: its name, declared refusals and shared tensors."""
    return SimpleNamespace(name=name, refuses=refuses or {}, pooled=pooled, shared_names=list(shared))


WHY = "its reason"
DORA = SimpleNamespace(name="d", refuses={"dora": ""}, pooled=False)
#: rule -> (settings that break it, the method, the engine, the refusal word for word)
EXAMPLES = {
    "drift_task": (
        {"eval__drift": True, "data__task": "causal_lm"}, None, None,
        "eval.drift: client drift compares the logits of the classification head, and data.task causal_lm "
        "has none (use data.task classification)",
    ),
    "drift_silos": (
        {"eval__drift": True, "data__silos": []}, None, None,
        "eval.drift: the probe batch comes from the global test set, which data.silos has not",
    ),
    "scaffold_optimizer": (
        {"train__correction": "scaffold"}, None, None,
        "train.correction scaffold: train.optimizer is adamw; SCAFFOLD's client control (x - y) / (K lr) "
        "is the mean of the local gradients only under plain SGD steps (Karimireddy et al. 2020, option "
        "II): set train.optimizer: sgd",
    ),
    "scaffold_secure": (
        {"train__correction": "scaffold", "train__optimizer": "sgd", "deploy__secure_aggregation": True},
        None, None,
        "train.correction scaffold: deploy.secure_aggregation sums the model updates alone, not the clients' "
        "control updates SCAFFOLD's server needs; use one or the other",
    ),
    "secure_uplink": (
        {"deploy__secure_aggregation": True, "comm__uplink__codec": "int8"}, None, None,
        "comm.uplink int8: deploy.secure_aggregation quantises and masks the update itself (SecAgg+ sums "
        "integers); a compressed update's codes cannot be summed. Use one or the other",
    ),
    "sample_quantized": (
        {"privacy__mode": "sample", "model__quantization": "int8"}, None, None,
        "privacy.mode sample: per-example gradients are a vmap over the rows, which model.quantization "
        "int8's kernels cannot run under; use user or local",
    ),
    "sample_checkpointing": (
        {"privacy__mode": "sample", "model__gradient_checkpointing": True}, None, None,
        "privacy.mode sample: per-example gradients are a vmap over the rows, which "
        "model.gradient_checkpointing cannot run under; turn one off",
    ),
    "sample_causal_lm": (
        {"privacy__mode": "sample", "data__task": "causal_lm"}, None, None,
        "privacy.mode sample: not for data.task causal_lm yet (a batch's scored positions are counted over "
        "the batch, not per example); use privacy.mode user or local",
    ),
    "secure_robust": (
        {"deploy__secure_aggregation": True, "server__aggregation": "median"}, None, None,
        "server.aggregation median: deploy.secure_aggregation hides the individual updates a robust rule "
        "reads; use one or the other",
    ),
    "task": (
        {}, method({"classification": WHY}), None,
        "method.name m: not defined for data.task classification; its reason",
    ),
    "fp16": (
        {"train__precision": "fp16"}, method({"fp16": WHY}), None,
        "train.precision: fp16 needs loss scaling, which method m (its reason) does not have; use bf16 "
        "(float32's range, no scaling needed) or fp32",
    ),
    "dora": (
        {"method__lora__use_dora": True}, method(), None,
        "method.lora.use_dora: not for method m: its own handling of LoRA's factors or adapters is not "
        "defined for DoRA's magnitudes (DoRA composes with d: its magnitudes are trained tensors beside "
        "the factors)",
    ),
    "server_step": (
        {"server__optimizer": "fedadam", "server__lr": 0.01}, method(shared=()), None,
        "server.optimizer fedadam (server.lr 0.01): method m: it shares no tensors for a server step to move",
    ),
    "robust": (
        {"server__aggregation": "median"}, method({"robust": WHY}), None,
        "server.aggregation median: method m: its reason",
    ),
    "prox": (
        {"train__prox_mu": 0.1}, method(pooled=True), None,
        "train.prox_mu 0.1: method m shares no tensors to anchor",
    ),
    "correction": (
        {"train__correction": "scaffold", "train__optimizer": "sgd"}, method({"server_step": WHY}), None,
        "train.correction scaffold: method m: its reason",
    ),
    "sample_dp": (
        {"privacy__mode": "sample"}, method({"sample_dp": "draws its own batches"}), None,
        "privacy.mode sample: method m draws its own batches, and DP-SGD's accountant needs one batch a "
        "step drawn without replacement",
    ),
    "user_dp": (
        {"privacy__mode": "user"}, method({"robust": WHY}), None,
        "privacy.mode user: method m: its reason; user-level DP noises only the sum of the updates, which "
        "this server does not take (privacy.mode local noises each update before it leaves)",
    ),
    "local_dp": (
        {"privacy__mode": "local"}, method({"local_dp": WHY}), None,
        "privacy.mode local: method m: its reason",
    ),
    "user_robust": (
        {"privacy__mode": "user", "server__aggregation": "krum"}, method(), None,
        "privacy.mode user: server.aggregation krum reads the individual updates, and user-level DP adds "
        "its noise to their sum only; use aggregation mean (or privacy.mode local, whose updates leave the "
        "clients noised)",
    ),
    "noised_scaffold": (
        {"privacy__mode": "local", "train__correction": "scaffold", "train__optimizer": "sgd"},
        method(), None,
        "privacy.mode: train.correction scaffold sends each client's control update beside its model "
        "update, and only the model update is clipped and noised; use one or the other",
    ),
    "adaptive_clip_secure": (
        {"privacy__mode": "user", "privacy__adaptive_clip": True, "deploy__secure_aggregation": True},
        method(), None,
        "privacy.adaptive_clip: each client's report (within the bound or not) would reach the server in "
        "the clear beside SecAgg+'s masked sum; use a fixed privacy.clip with deploy.secure_aggregation",
    ),
    "lossy_downlink": (
        {"comm__downlink__codec": "nf4"}, method({"lossy_downlink": WHY}), None,
        "comm.downlink nf4: method m: its reason",
    ),
    "silos_head": (
        {"data__silos": []}, method(shared=("lora.A", "head.weight")), None,
        "data.silos: method m would aggregate classifiers across tasks (head.weight, ...); each silo has its "
        "own label space: set method.head: personal",
    ),
    "faults_pooled": (
        {"faults__byzantine_clients": 2}, method(pooled=True), "ranks",
        "faults.byzantine_clients: method m pools the data; no client sends",
    ),
    "deployed_faults": (
        {"faults__byzantine_clients": 2}, None, "deployment",
        "faults.byzantine_clients: faulty clients are simulated by the in-process engine (`fedpeft run`); a "
        "deployed node runs its own code",
    ),
    "deployed_drift": (
        {"eval__drift": True}, None, "deployment",
        "eval.drift: client drift is measured by the in-process engine (`fedpeft run`); a deployed server "
        "never holds a client's model after its round. Set eval.drift: false to deploy",
    ),
    "deployed_pooled": (
        {}, method(pooled=True, name="centralized"), "deployment",
        "method 'centralized' trains on all clients' data pooled in one place; it is a reference for "
        "simulations and cannot run across machines",
    ),
    "deployed_personal": (
        {"export__personal": True}, method(), "deployment",
        "export.personal: in a deployment each client's personal state stays on its node, so the server "
        "cannot export clients' models; export them in a simulation (fedpeft run)",
    ),
    "secure_method": (
        {"deploy__secure_aggregation": True}, method({"secure_aggregation": WHY}), "deployment",
        "deploy.secure_aggregation: method 'm' does not aggregate by the example-weighted mean of the "
        "updates, which is all SecAgg+ can compute",
    ),
    "secure_cohort": (
        {"deploy__secure_aggregation": True, "train__clients_per_round": 1}, method(), "deployment",
        "deploy.secure_aggregation needs train.clients_per_round >= 2",
    ),
    "secure_weight_share": (
        {"deploy__secure_aggregation": True, "deploy__max_weight_share": 0.5}, method(), "deployment",
        "deploy.max_weight_share 0.5: under deploy.secure_aggregation each client weighs its own masked "
        "update, which the server cannot reweigh; use deploy.max_weight_share 1 (a weight is still bounded "
        "by its roll call)",
    ),
}  # fmt: skip


def test_every_rule_has_an_example_and_a_name_of_its_own():
    names = [rule.name for rule in C.RULES]
    assert len(set(names)) == len(names)
    assert set(names) == set(EXAMPLES)
    assert all(rule.stage in C.STAGES and set(rule.engines) <= set(C.ENGINES) for rule in C.RULES)
    assert all(rule.feature_of(BASE) in (None, *C.FEATURES) for rule in C.RULES)


@pytest.mark.parametrize("rule", C.RULES, ids=lambda rule: rule.name)
def test_each_rule_refuses_what_breaks_it_in_its_own_words(rule):
    settings, m, engine, says = EXAMPLES[rule.name]
    cfg = varied(BASE, **settings)
    methods = {"d": DORA, "m": m} if m is not None else None
    assert C.broken(rule, cfg, m, methods) == says
    assert C.refusal(cfg, m, engine=engine, stage=rule.stage, methods=methods) == says
    if rule.engines != C.ENGINES:  # a rule of one engine: not the others'
        assert C.refusal(cfg, m, stage=rule.stage) is None
        others = set(C.ENGINES) - set(rule.engines)
        assert all(C.refusal(cfg, m, engine=e, stage=rule.stage) != says for e in others)
    if rule.stage != "config":  # checked no earlier than it can be
        earlier = C.STAGES[C.STAGES.index(rule.stage) - 1]
        assert C.refusal(cfg, m, engine=engine, stage=earlier, methods=methods) is None
    assert C.broken(rule, BASE, method({"dora": ""}) if m is not None else None) == ""


def test_a_config_every_rule_takes_is_refused_by_none():
    for engine in (None, *C.ENGINES):
        assert C.refusal(BASE, engine=engine) is None
        assert C.refusal(BASE, method({"dora": ""}), engine=engine) is None


def test_the_config_refuses_its_rules_as_it_is_read():
    with pytest.raises(ConfigError, match=r"^x\.yaml: train\.correction scaffold: train\.optimizer is adamw"):
        parse_config({"train": {"correction": "scaffold"}}, "x.yaml")
    user = {"mode": "user", "noise_multiplier": 1.0}
    cfg = parse_config({"privacy": user, "server": {"aggregation": "median"}})
    assert C.refusal(cfg) is None  # a rule of set-up: refused when the method is built
    assert C.refusal(cfg, method()).startswith("privacy.mode user: server.aggregation median reads")


def test_the_methods_declarations_are_read_with_their_defaults():
    assert C.declined(method({"server_step": WHY}), "user_dp") == WHY  # user_dp -> robust -> server_step
    assert C.declined(method(), "dora") == C.DORA_UNDEFINED
    assert C.declined(method(shared=()), "correction") == C.SHARES_NOTHING
    assert C.declined(method({"dora": ""}), "dora") == ""
    with pytest.raises(KeyError, match="no feature 'dp'"):
        C.declined(method(), "dp")


def _docs_script():
    path = ROOT / "scripts" / "composition_docs.py"
    spec = importlib.util.spec_from_file_location("composition_docs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_documented_tables_are_what_the_data_makes():
    docs = _docs_script()
    text = docs.PAGE.read_text()
    stale = "docs/composition.md is stale: python scripts/composition_docs.py"
    assert docs.generated_page(text) == text, stale
    for rule in C.RULES:
        assert f"| `{rule.name}` |" in text
