"""The layers around every method's server (issue 32): server optimisers (each step
against a worked example of its formula, FedAvgM at momentum 0 and rate 1 and FedProx at
mu 0 equal to FedAvg bit for bit in a whole run, the state kept on the server), robust
aggregation against numpy and a hand-scored Krum, simulated faulty clients, and the
refusals."""

import math

import numpy as np
import pytest
import torch

from fedpeft.config import ConfigError, FaultsConfig, ServerConfig, parse_config
from fedpeft.engines.faults import corrupt, faulty_clients
from fedpeft.engines.robust import combiner, krum_scores
from fedpeft.engines.server_opt import as_weighted, server_step
from fedpeft.experiment import build, make_engine
from fedpeft.methods.base import FitResult, ServerState


def _two_rounds(cfg: ServerConfig, first: float, second: float) -> tuple[list[float], list[float]]:
    """x after each of two rounds whose aggregates sit at ``x + first`` and then ``x + second``
    in the first coordinate (the second coordinate's aggregate never moves: D = 0)."""
    server = ServerState({"w": torch.tensor([1.0, -2.0])})
    out = []
    for d in (first, second):
        proposed = ServerState({"w": server.tensors["w"] + torch.tensor([d, 0.0])}, server.extras)
        server = server_step(cfg, server, proposed)
        out.append(server.tensors["w"].tolist())
    return out[0], out[1]


# Worked by hand from the formulas (lr 0.4, b1 0.5, b2 0.75, tau 0.5; m starts at 0, v at
# tau^2 = 0.25). Round 1, D = 0.5: m = 0.25. Round 2, D = 1.0: m = 0.5 * 0.25 + 0.5 = 0.625.
ADAPTIVE = {"lr": 0.4, "betas": (0.5, 0.75), "tau": 0.5}
WORKED = {
    # v = 0.75 * 0.25 + 0.25 * 0.25 = 0.25; then 0.75 * 0.25 + 0.25 * 1 = 0.4375
    "fedadam": (0.25, 0.4375),
    # v = 0.25 + 0.25 = 0.5; then 0.5 + 1 = 1.5
    "fedadagrad": (0.5, 1.5),
    # v = 0.25 - 0.25 * 0.25 * sign(0.25 - 0.25) = 0.25; then 0.25 - 0.25 * 1 * sign(0.25 - 1) = 0.5
    "fedyogi": (0.25, 0.5),
}


@pytest.mark.parametrize("name", sorted(WORKED))
def test_an_adaptive_step_is_its_formula(name):
    v1, v2 = WORKED[name]
    one, two = _two_rounds(ServerConfig(optimizer=name, **ADAPTIVE), 0.5, 1.0)
    x1 = 1 + 0.4 * 0.25 / (math.sqrt(v1) + 0.5)
    assert one[0] == pytest.approx(x1, rel=1e-6)
    assert two[0] == pytest.approx(x1 + 0.4 * 0.625 / (math.sqrt(v2) + 0.5), rel=1e-6)
    assert one[1] == two[1] == -2.0  # D = 0 and m = 0: no move, whatever v


def test_server_momentum_is_its_formula():
    # v = 0.5, x = 1.5; then v = 0.5 * 0.5 + 0.5 = 0.75, x = 1.5 + 0.75 (lr 1)
    one, two = _two_rounds(ServerConfig(optimizer="fedavgm", momentum=0.5), 0.5, 0.5)
    assert one[0] == 1.5 and two[0] == 2.25
    # fedavg at rate 0.5 moves halfway to each aggregate
    one, two = _two_rounds(ServerConfig(optimizer="fedavg", lr=0.5), 0.5, 0.5)
    assert one[0] == 1.25 and two[0] == 1.5


def test_fedavgm_at_momentum_0_and_rate_1_and_fedprox_at_mu_0_are_fedavg_bit_for_bit(tiny_config, tmp_path):
    common = {"train.rounds": 3, "partition.num_clients": 4, "eval.every": 3}
    runs = {}
    variants = {"fedavg": {}, "fedavgm": {"server.optimizer": "fedavgm", "server.momentum": 0.0},
                "fedprox": {"train.prox_mu": 0.0}}  # fmt: skip
    for name, server in variants.items():
        (tmp_path / name).mkdir()
        engine = make_engine(build(tiny_config(**common, **server, output_dir=str(tmp_path / name))), None)
        records = engine.run()
        runs[name] = (engine.server, records[-1])
    plain, last = runs.pop("fedavg")
    for other, last_o in runs.values():  # FedAvgM at (0, 1); FedProx at mu 0
        assert plain.tensors.keys() == other.tensors.keys()
        assert all(torch.equal(t, other.tensors[n]) for n, t in plain.tensors.items())
        assert last["global"] == last_o["global"]
    momentum = runs["fedavgm"][0]
    assert any(k.startswith("server_opt.v.") for k in momentum.extras)  # it did run the optimiser


def test_the_optimiser_state_stays_on_the_server(tiny_config):
    setup = build(tiny_config(**{"train.rounds": 2, "server.optimizer": "fedadam", "server.lr": 0.01}))
    setup.cfg.output_dir.mkdir(parents=True)
    engine = make_engine(setup, None)
    engine.run()
    state = [k for k in engine.server.extras if k.startswith("server_opt.")]
    assert {k.split(".")[1] for k in state} == {"m", "v"}
    sent = setup.method.downlink(engine.server, 0)
    assert sent.keys() == set(setup.method.shared_names)  # the downlink: the shared tensors only


def test_an_adaptive_optimiser_needs_its_rate(tiny_config):
    with pytest.raises(ValueError, match=r"server\.lr: server\.optimizer fedyogi"):
        tiny_config(**{"server.optimizer": "fedyogi"})
    with pytest.raises(ValueError, match=r"server.betas: each in \[0, 1\)"):
        parse_config({"server": {"optimizer": "fedadam", "lr": 0.1, "betas": [0.9, 1.0]}}, "x.yaml")


@pytest.mark.parametrize("method", {"fdlora": "outer step", "fedamp": "own mixing", "local": "no sharing"})
def test_a_method_with_its_own_server_step_refuses_a_server_optimiser(tiny_config, method):
    cfg = tiny_config(**{"method": {"name": method}, "server.optimizer": "fedadam", "server.lr": 0.01})
    with pytest.raises(ConfigError, match=f"server.optimizer fedadam .*method {method}: "):
        build(cfg)


def test_uniform_weighting_gives_each_client_one_share(tiny_config):
    method = build(tiny_config()).method
    results = [
        FitResult({"w": torch.tensor([0.0])}, {}, 30, cid=0),
        FitResult({"w": torch.tensor([3.0])}, {}, 10, cid=1),
    ]
    server = ServerState({"w": torch.tensor([0.0])})
    by_examples = method.aggregate(server, as_weighted(ServerConfig(), results), 1)
    uniform = method.aggregate(server, as_weighted(ServerConfig(weighting="uniform"), results), 1)
    assert by_examples.tensors["w"].item() == 0.75 and uniform.tensors["w"].item() == 1.5
    assert [r.num_examples for r in results] == [30, 10]  # the records' counts untouched


def test_fedprox_needs_shared_tensors(tiny_config):
    with pytest.raises(ConfigError, match=r"train\.prox_mu 0\.1: method local"):
        build(tiny_config(**{"method": {"name": "local"}, "train.prox_mu": 0.1}))


# ---------------------------------------------------------------- robust aggregation


def _states(rows: list[list[float]]) -> list[dict]:
    """One state per row: its first two values as tensor "a", the rest as "b"."""
    return [{"a": torch.tensor(r[:2]), "b": torch.tensor(r[2:])} for r in rows]


def _as_array(state: dict) -> np.ndarray:
    return np.concatenate([state["a"].numpy(), state["b"].numpy()])


CRAFTED = [
    [0.0, 1.0, 2.0],
    [0.2, 0.9, 2.1],
    [-0.1, 1.2, 1.9],
    [0.1, 1.1, 2.2],
    [50.0, -40.0, 9.0],
    [0.05, 0.95, 2.05],
]


@pytest.mark.parametrize(("rule", "numpy_rule"), [
    ("median", lambda x: np.median(x, axis=0)),
    ("trimmed_mean", lambda x: np.sort(x, axis=0)[1:-1].mean(0)),  # trim 0.2 of 6: one at each end
])  # fmt: skip
def test_coordinate_wise_rules_match_numpy(rule, numpy_rule):
    combine = combiner(ServerConfig(aggregation=rule, trim=0.2))
    got = _as_array(combine(_states(CRAFTED), [1.0] * len(CRAFTED)))
    np.testing.assert_allclose(got, numpy_rule(np.array(CRAFTED, dtype=np.float32)), rtol=1e-6)
    five = CRAFTED[:5]  # an odd count: the middle value
    np.testing.assert_allclose(
        _as_array(combiner(ServerConfig(aggregation="median"))(_states(five), [1.0] * 5)),
        np.median(np.array(five, dtype=np.float32), axis=0),
    )


def test_krum_picks_from_the_honest_cluster():
    """Five honest updates near (0, 1, 2) and two attackers far away: Krum's score of each
    state is, by hand, the sum of its n - f - 2 = 3 smallest squared distances to the others."""
    rows = [*CRAFTED[:4], CRAFTED[5], [50.0, -40.0, 9.0], [-30.0, 20.0, -7.0]]
    x = np.array(rows)
    squared = ((x[:, None] - x[None]) ** 2).sum(-1)
    by_hand = np.sort(squared, axis=1)[:, 1:4].sum(1)
    states = _states(rows)
    np.testing.assert_allclose(krum_scores(states, 2).numpy(), by_hand, rtol=1e-5)
    picked = _as_array(combiner(ServerConfig(aggregation="krum", byzantine=2))(states, [1.0] * 7))
    assert picked.tolist() == pytest.approx(rows[int(by_hand.argmin())]) and int(by_hand.argmin()) < 5
    multi = _as_array(combiner(ServerConfig(aggregation="multi_krum", byzantine=2))(states, [1.0] * 7))
    np.testing.assert_allclose(multi, x[np.sort(np.argsort(by_hand)[:5])].mean(0), rtol=1e-6)
    assert set(np.argsort(by_hand)[:5].tolist()) == set(range(5))  # the five honest ones
    with pytest.raises(ValueError, match=r"server\.byzantine 3: .*2f \+ 2 = 8"):
        krum_scores(states, 3)


def test_a_robust_rule_replaces_the_methods_mean_in_a_run(tiny_config, tmp_path):
    """Median aggregation through the engine: each round's global tensors are the
    coordinate-wise median of the clients' uplinks (three clients: the middle one)."""
    cfg = tiny_config(**{"train.rounds": 1, "partition.num_clients": 3, "train.clients_per_round": 3,
                         "server.aggregation": "median"})  # fmt: skip
    setup = build(cfg)
    uplinks = []
    real = setup.method.aggregate
    setup.method.aggregate = lambda server, results, rnd: (
        uplinks.extend(r.uplink for r in results) or real(server, results, rnd)
    )
    cfg.output_dir.mkdir(parents=True)
    engine = make_engine(setup, None)
    engine.run()
    for name, t in engine.server.tensors.items():
        torch.testing.assert_close(t, torch.stack([u[name] for u in uplinks]).median(0).values)


def test_robust_rules_refuse_what_they_cannot_read(tiny_config):
    with pytest.raises(ConfigError, match=r"server\.aggregation median: method hetlora: .*weighs"):
        build(tiny_config(**{"method": {"name": "hetlora"}, "server.aggregation": "median"}))
    with pytest.raises(ValueError, match=r"server\.aggregation krum: deploy\.secure_aggregation"):
        tiny_config(**{"server.aggregation": "krum", "deploy.secure_aggregation": True})
    # Krum needs more than 2f + 2 updates a round: refused before anything is built
    with pytest.raises(ValueError, match=r"server\.byzantine 1 .*2f \+ 2 = 4 .*asks 4"):
        tiny_config(**{"server.aggregation": "multi_krum", "train.clients_per_round": 4})
    tiny_config(**{"server.aggregation": "krum", "train.clients_per_round": 4, "server.byzantine": 0})


# ---------------------------------------------------------------- faulty clients


def test_faulty_clients_are_drawn_from_the_seed():
    cfg = FaultsConfig(byzantine_clients=3)
    a, b, c = faulty_clients(cfg, 0, 10), faulty_clients(cfg, 0, 10), faulty_clients(cfg, 1, 10)
    assert a == b and a != c and len(set(a)) == 3 and all(0 <= x < 10 for x in a)
    # more faulty clients of the same seed add to the fewer's: 10 % and 30 % are nested sets
    for seed in range(5):
        sets = [set(faulty_clients(FaultsConfig(byzantine_clients=k), seed, 20)) for k in range(21)]
        assert all(len(s) == k and sets[k - 1] < s for k, s in enumerate(sets) if k), seed
    with pytest.raises(ConfigError, match=r"faults\.byzantine_clients: 11\b.*partition\.num_clients is 10"):
        faulty_clients(FaultsConfig(byzantine_clients=11), 0, 10)


def test_model_attacks_are_their_formulas():
    received = {"w": torch.tensor([1.0, 2.0])}
    honest = FitResult({"w": torch.tensor([1.5, 1.0])}, {}, 5, cid=2)  # update (0.5, -1)
    flip = corrupt(FaultsConfig(attack="sign_flip"), honest, received, 0, 1, "fedlr")
    scale = corrupt(FaultsConfig(attack="scale", scale=3.0), honest, received, 0, 1, "fedlr")
    noise = [
        corrupt(FaultsConfig(attack="gaussian", noise_std=2.0), honest, received, 0, r, "fedlr")
        for r in (1, 1, 2)
    ]
    assert flip.uplink["w"].tolist() == [0.5, 3.0] and scale.uplink["w"].tolist() == [2.5, -1.0]
    assert torch.equal(noise[0].uplink["w"], noise[1].uplink["w"])  # seeded by seed, round and client
    assert not torch.equal(noise[0].uplink["w"], noise[2].uplink["w"])
    assert honest.uplink["w"].tolist() == [1.5, 1.0]  # the client's own result untouched


def test_a_sign_flipping_client_sends_its_update_reversed(tiny_config, tmp_path):
    """The same run with and without one faulty client of three: the faulty one trains the
    same round and sends ``2 received - uplink``; the others send the same; the record names it."""
    common = {"train.rounds": 1, "partition.num_clients": 3, "train.clients_per_round": 3}
    sent = {}
    for name, over in {"honest": {}, "faulty": {"faults.byzantine_clients": 1}}.items():
        setup = build(tiny_config(**common, **over, output_dir=str(tmp_path / name)))
        received = setup.method.init_server(setup.model).tensors
        real = setup.method.aggregate
        setup.method.aggregate = lambda server, results, rnd, real=real, name=name: (
            sent.update({name: {r.cid: r.uplink for r in results}}) or real(server, results, rnd)
        )
        setup.cfg.output_dir.mkdir(parents=True)
        records = make_engine(setup, None).run()
    (bad,) = faulty_clients(FaultsConfig(byzantine_clients=1), setup.cfg.seed, 3)
    assert records[0]["byzantine"] == [bad]
    for cid, uplink in sent["honest"].items():
        for n, t in uplink.items():
            want = 2 * received[n].double() - t.double() if cid == bad else t.double()
            torch.testing.assert_close(sent["faulty"][cid][n].double(), want, atol=1e-6, rtol=0)


def test_label_flipping_clients_train_on_flipped_labels(tiny_config, tmp_path):
    cfg = tiny_config(**{"faults.byzantine_clients": 2, "faults.attack": "label_flip"})
    setup = build(cfg)
    before = [c.train.labels.clone() for c in setup.clients]
    cfg.output_dir.mkdir(parents=True)
    engine = make_engine(setup, None)
    bad = faulty_clients(cfg.faults, cfg.seed, len(setup.clients))
    classes = setup.corpus.num_classes
    for cid, labels in enumerate(before):
        want = classes - 1 - labels if cid in bad else labels
        assert torch.equal(engine.clients[cid].train.labels, want)
    # the setup's own clients keep their labels: a second engine on it flips them again, once
    assert all(torch.equal(c.train.labels, b) for c, b in zip(setup.clients, before, strict=True))
    again = make_engine(setup, None)
    assert all(
        torch.equal(a.train.labels, e.train.labels)
        for a, e in zip(again.clients, engine.clients, strict=True)
    )


def test_a_model_attack_needs_an_uplink_of_received_tensors(tiny_config, tmp_path):
    setup = build(tiny_config(**{"method": {"name": "fedkd"}, "faults.byzantine_clients": 4,
                                 "partition.num_clients": 4, "train.rounds": 1}))  # fmt: skip
    setup.cfg.output_dir.mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"faults\.attack sign_flip: method fedkd"):
        make_engine(setup, None).run()


def test_a_deployment_refuses_simulated_faults(tiny_config):
    from fedpeft.flower.deploy import check_deployable

    with pytest.raises(ConfigError, match=r"faults\.byzantine_clients: .*in-process"):
        check_deployable(tiny_config(**{"faults.byzantine_clients": 1}))
