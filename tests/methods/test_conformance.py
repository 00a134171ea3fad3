"""Conformance suite: every registered method, 2 rounds x a few clients on a tiny model
(the checks: tests/helpers/conformance.py).

A new method joins by being registered; if what it trains is not its kind's tensors and
the head (or it has no kind), by one line in CLAIMS. Its interface is Method's hooks, each
written down in docs/architecture.md ("Adding a method").
"""

import re
import typing
from pathlib import Path

import pytest
import torch

from fedpeft.engines.checkpoint import load_checkpoint
from fedpeft.experiment import build, fingerprint, run
from fedpeft.methods import REGISTRY
from fedpeft.methods.base import Method, load_tensors
from fedpeft.methods.capabilities import DORA_UNDEFINED, FEATURES, SHARES_NOTHING, refusal
from tests.helpers.conformance import PRIVATE, assert_conforms

#: What a method trains where its kind's tensors and the head do not say it (or it has no
#: kind): a predicate over parameter names
CLAIMS = {
    "prompt_tuning": lambda n: n == "backbone.prompt.embedding.weight" or n.startswith("head."),
    "compacter": lambda n: ".adapter." in n or n.startswith("head."),
    "adamix": lambda n: ".adapter." in n or n.startswith("head."),
    "c2a": lambda n: n.startswith(("hyper.", "head.")),
    "fedmcp": lambda n: ".adapter." in n or n.startswith(("head.", "global_head.")),
    "fedrod": lambda n: "lora_" in n or n.startswith(("head.", "personal_head.")),
    "fedkd": lambda n: "lora_" in n or n.startswith(("head.", "mentor_head.")),
    "ffalora": lambda n: "lora_B" in n or n.startswith("head."),  # A frozen
    "fedsb": lambda n: n.endswith(".lora_B.default.latent.weight") or n.startswith("head."),  # R only
}

ARCHITECTURE = Path(__file__).parents[2] / "docs" / "architecture.md"


def record_fits(method) -> list:
    """The FitResults of every local round ``method`` runs from now on, in order."""
    results, real_fit_cohort = [], method.fit_cohort

    def fit_cohort(model, jobs):
        out = real_fit_cohort(model, jobs)
        results.extend(out)
        return out

    method.fit_cohort = fit_cohort
    return results


def test_every_claim_names_a_registered_method():
    assert set(CLAIMS) <= set(REGISTRY)


def test_every_hook_of_a_method_is_written_down():
    """``Method``'s public members (with all it inherits) are its one way to be extended:
    each is named in docs/architecture.md's "Adding a method", and they stay few."""
    public = [n for n in dir(Method) if not n.startswith("_")]
    assert len(public) <= 40, public
    section = ARCHITECTURE.read_text().split("## Adding a method", 1)[1].split("\n## ", 1)[0]
    written = set(re.findall(r"`(\w+)`", section))
    assert not set(public) - written, sorted(set(public) - written)


def test_fit_cohort_is_the_engines_alone():
    """No method overrides ``fit_cohort`` (the engines' entry); a round of phases overrides
    ``local_rounds``."""
    assert not [name for name, cls in REGISTRY.items() if cls.fit_cohort is not Method.fit_cohort]


def test_each_method_refuses_only_known_features():
    for name, cls in REGISTRY.items():
        unknown = set(cls.refuses) - set(FEATURES)
        assert not unknown, f"{name} refuses {unknown}, not among capabilities.FEATURES"
        assert all(isinstance(why, str) for why in cls.refuses.values()), name


def test_refusals_agree_with_what_each_method_overrides():
    """A method whose server reads more than the mean of the updates declares that SecAgg+
    cannot hide them, and one that draws its own batches declares DP-SGD's accountant
    does not fit: the data says what the code does."""
    for name, cls in REGISTRY.items():
        own_aggregate = cls.aggregate is not Method.aggregate
        assert bool(refusal(cls, "secure_aggregation")) == (own_aggregate or cls.pooled), name
        assert bool(refusal(cls, "sample_dp")) == (cls.step_draws is not Method.step_draws), name


def test_undeclared_refusals_fall_back_as_documented(tiny_config):
    method = build(tiny_config(method={"name": "fedft"})).method  # FedAvg: composes with every layer
    assert all(refusal(method, f) == "" for f in FEATURES if f != "dora")
    assert refusal(method, "dora") == DORA_UNDEFINED  # DoRA is opt-in
    method.shared_names = []  # shares nothing: no server step, hence no correction, robust rule, user DP
    refused = {f for f in FEATURES if refusal(method, f)}
    assert refused == {"dora", "server_step", "correction", "robust", "user_dp"}
    assert refusal(method, "user_dp") == SHARES_NOTHING
    with pytest.raises(KeyError, match="no feature 'dp'"):
        refusal(method, "dp")


@pytest.fixture(params=sorted(REGISTRY))
def method_name(request):
    return request.param


def test_conformance(method_name, tiny_config):
    assert_conforms(method_name, tiny_config, CLAIMS.get(method_name))


def test_local_only_sends_nothing(tiny_config):
    cfg = tiny_config(**{"method": {"name": "local"}})
    summary = run(cfg)
    assert summary["total_bytes"] == 0
    assert summary["params"]["shared"] == 0 and summary["params"]["personal"] > 0
    assert summary["final_global"] is not None  # mean of clients' own models on the global test


def test_head_can_be_personal(tiny_config):
    cfg = tiny_config(**{"method": {"name": "fedlr", "head": "personal"}})
    setup = build(cfg)
    assert all(n.startswith("head.") for n in setup.method.personal_names)
    summary = run(cfg, setup=setup)
    head = sum(p.numel() for p in setup.model.head.parameters())
    assert summary["params"]["personal"] == head


def test_personal_head_is_trained_and_kept(method_name, tiny_config):
    """With ``head: personal`` every method trains each client's own head and keeps it."""
    if method_name == "centralized":
        pytest.skip("centralized has one pooled client: its head is shared by definition")
    if "personal" not in typing.get_args(REGISTRY[method_name].config_cls.model_fields["head"].annotation):
        pytest.skip(f"{method_name}: each of its modules has its own head (a personal head is not an option)")
    cfg = tiny_config(**{
        "method": {"name": method_name, "head": "personal"}, "train.rounds": 2, "partition.num_clients": 3,
    })  # fmt: skip
    setup = build(cfg)
    head = [n for n in setup.method.personal_names if n.startswith("head.")]
    assert head and not any(n.startswith("head.") for n in setup.method.shared_names)
    run(cfg, setup=setup)
    ckpt = load_checkpoint(cfg.output_dir / "checkpoint.pt", fingerprint(cfg))
    assert ckpt.personal, "no client kept a personal state"
    for cid, state in ckpt.personal.items():
        assert set(head) <= set(state), cid
        assert any(not torch.equal(state[n], setup.initial[n]) for n in head), f"client {cid}: head untrained"
    heads = list(ckpt.personal.values())
    assert any(not torch.equal(heads[0]["head.weight"], h["head.weight"]) for h in heads[1:])


def test_centralized_has_one_shared_head(tiny_config):
    from fedpeft.config import ConfigError

    with pytest.raises(ConfigError, match=r"method\.head .*'shared' .*centralized"):
        tiny_config(**{"method": {"name": "centralized", "head": "personal"}})


@pytest.mark.parametrize(
    "name",
    ["local", "pf2lora", "fedlr", "hetlora", "perfedavg", pytest.param("flora", marks=pytest.mark.slow)],
)
def test_every_client_is_scored_trained_or_not(name, tiny_config):
    """4 clients, 1 per round, 2 rounds: at most 2 train, all 4 are scored, each with its
    own model or, never having trained, the global model and its initial personal state."""
    import numpy as np

    from fedpeft.metrics.classification import predict, scores
    from fedpeft.report.results import read_records

    cfg = tiny_config(**{"method": {"name": name}, "train.clients_per_round": 1})
    setup = build(cfg)
    summary = run(cfg, setup=setup)
    records = read_records(cfg.output_dir)
    trained = {c for r in records for c in r["clients"]}
    assert len(trained) < 4 and records[-1]["clients_evaluated"] == 4
    ckpt = load_checkpoint(cfg.output_dir / "checkpoint.pt", fingerprint(cfg))
    assert set(ckpt.personal) == trained
    method, model = setup.method, setup.model
    by_hand = []
    for client in setup.clients:
        personal = ckpt.personal.get(client.cid) or method.init_client(model, setup.initial, client)
        received = method.downlink(ckpt.server, client.cid)
        load_tensors(model, method.eval_state(model, received, personal, client))
        by_hand.append(scores(predict(model, client.test, 64), client.test.labels.numpy())["accuracy"])
    assert summary["final_local"]["accuracy_mean"] == pytest.approx(np.mean(by_hand), abs=1e-9)


def test_a_setup_runs_twice_from_the_same_start(tiny_config, tmp_path):
    cfg = tiny_config()
    setup = build(cfg)
    first = run(cfg, setup=setup)
    second = run(cfg.model_copy(update={"output_dir": tmp_path / "again"}), setup=setup)
    assert first["final_global"] == second["final_global"]


@pytest.mark.parametrize(
    "name", ["local", "fedlr", "pf2lora", pytest.param("perfedavg", marks=pytest.mark.slow), "hetlora"]
)  # Per-FedAvg (~8 s) in the slow tier: the default tier's 10 minutes
def test_kept_optimizer_state_carries_over_rounds(name, tiny_config, tmp_path):
    """``train.optimizer_state: keep``: each client's Adam state lives on in its personal
    state (never sent) and resumes where it stopped: after 2 rounds of 2 steps its step
    count is 4. With ``reset`` (the default) nothing is kept."""
    over = {"method": {"name": name}, "partition.num_clients": 3, "train.clients_per_round": 3}
    for mode in ("keep", "reset"):
        cfg = tiny_config(**over, **{"train.optimizer_state": mode, "output_dir": str(tmp_path / mode)})
        setup = build(cfg)
        results = record_fits(setup.method)
        run(cfg, setup=setup)
        assert results and not any(n.startswith(PRIVATE) for r in results for n in r.uplink)
        ckpt = load_checkpoint(cfg.output_dir / "checkpoint.pt", fingerprint(cfg))
        for cid, state in ckpt.personal.items():
            steps = {n: float(t) for n, t in state.items() if n.startswith("opt.step.")}
            if mode == "reset":
                assert not any(n.startswith("opt.") for n in state), cid
                continue
            assert steps and set(steps.values()) == {4.0}, (cid, steps)
            moments = [t for n, t in state.items() if n.startswith("opt.exp_avg.")]
            assert moments and any(t.abs().sum() > 0 for t in moments)
        assert not any(n.startswith(PRIVATE) for n in ckpt.server.tensors)


def test_kept_optimizer_state_is_read_back_exactly(tiny_config):
    """A client's kept AdamW state (its ``opt.*`` personal entries) is what its next round
    starts from; with ``reset`` every round starts fresh."""
    from fedpeft.engines.local import OPT, optimizer_init, optimizer_state

    cfg = tiny_config(**{"train.optimizer_state": "keep"})
    params = {"a": torch.randn(3, 2), "b": torch.randn(4)}
    kept = {f"{OPT}{k}": torch.rand_like(v) + 1 for k, v in optimizer_init(params, cfg.train).items()}
    state = optimizer_state({**kept, "head.weight": torch.zeros(1)}, params, cfg.train)
    assert state.keys() == {k.removeprefix(OPT) for k in kept}
    assert all(torch.equal(state[k.removeprefix(OPT)], v) for k, v in kept.items())
    fresh = optimizer_state(kept, params, cfg.train.model_copy(update={"optimizer_state": "reset"}))
    assert all(float(t.abs().sum()) == 0 for t in fresh.values())
