"""Differential privacy of what leaves a client (issue 34, items 2-4): clipping, the
noise's scale, the accountant against the library's own composition, the budget, the
refusals, bit-for-bit equality without noise, and a resumed run's epsilon and clip."""

from __future__ import annotations

import logging
import math

import dp_accounting
import pytest
import torch

from fedpeft.config import ConfigError, PrivacyConfig
from fedpeft.engines import checkpoint as C
from fedpeft.engines import privacy as DP
from fedpeft.engines.round import sample_clients
from fedpeft.experiment import build, fingerprint, make_engine, run
from fedpeft.methods.base import FitResult
from fedpeft.report.results import read_records, read_summary
from tests.helpers.configs import FEDSB
from tests.helpers.flower import deploy, in_process_and_deployed, serve
from tests.helpers.runs import whole_and_resumed

pytestmark = pytest.mark.usefixtures("forget_nodes")  # tests/conftest.py: the fake federation's nodes


def state(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(30, 4, generator=g) * scale, "b": torch.randn(7, generator=g) * scale}


def test_an_update_is_clipped_to_the_bound_jointly_and_left_alone_within_it():
    p = PrivacyConfig(mode="user", noise_multiplier=1.0, clip=0.5)
    received = state(0)
    big = {n: x + 3 * d for (n, x), d in zip(received.items(), state(1).values(), strict=True)}
    out = DP.privatise(p, big, received, 0.5, 1.0, seed=0, method="m")
    assert not out.fitted and out.norm > 0.5
    sent = DP.update_of(out.uplink, received, "m")
    assert DP.norm(sent) == pytest.approx(0.5, rel=1e-5)
    # the direction kept: every tensor scaled by the same factor
    raw = DP.update_of(big, received, "m")
    factor = 0.5 / DP.norm(raw)
    for name in raw:
        torch.testing.assert_close(sent[name], raw[name] * factor, rtol=1e-5, atol=1e-6)
    small = {n: x + 1e-3 * d for (n, x), d in zip(received.items(), state(1).values(), strict=True)}
    within = DP.privatise(p, small, received, 0.5, 1.0, seed=0, method="m")
    assert within.fitted and within.uplink is small  # user mode: nothing added on the client
    # local mode: the same clip, then the client's own noise on the clipped update
    local = PrivacyConfig(mode="local", noise_multiplier=1.0, clip=0.5)
    quiet = DP.update_of(
        DP.privatise(local, big, received, 0.5, 0.0, seed=0, method="m").uplink, received, "m"
    )
    for name in raw:
        torch.testing.assert_close(quiet[name], sent[name], rtol=1e-6, atol=1e-7)
    noisy = DP.update_of(
        DP.privatise(local, big, received, 0.5, 1.0, seed=0, method="m").uplink, received, "m"
    )
    added = torch.cat([(noisy[n] - sent[n]).flatten() for n in raw])
    assert float(added.std()) == pytest.approx(1.0 * 0.5, rel=0.3)  # sigma C, on 127 values


def test_the_noise_has_std_sigma_c_on_the_sum_and_sigma_c_locally():
    sigma, clip, per_round = 1.5, 0.25, 4
    p = PrivacyConfig(mode="user", noise_multiplier=sigma, clip=clip)
    x = {"w": torch.zeros(200_000)}
    # four clients whose updates are all zero: the method's mean of the restated uplinks is
    # x + N(0, (sigma C)^2) / S
    results = [FitResult({"w": torch.zeros(200_000)}, {}, 10, cid=c) for c in range(per_round)]
    restated, record, _ = DP.server_side(
        p, results, [x] * per_round, [True] * 4, clip, per_round, sigma, seed=3
    )
    assert all(r.num_examples == 1 for r in restated)  # uniform weights
    mean = torch.stack([r.uplink["w"] for r in restated]).mean(0)
    assert float(mean.std()) * per_round == pytest.approx(sigma * clip, rel=0.01)
    assert abs(float(mean.mean())) < 5 * sigma * clip / per_round / math.sqrt(200_000)
    assert record == {"clip": clip, "clipped": 0, "reclipped": 0}
    # local mode: each client adds N(0, (sigma C)^2) to its own (clipped) update
    local = PrivacyConfig(mode="local", noise_multiplier=sigma, clip=clip)
    out = DP.privatise(local, x, {"w": torch.zeros(200_000)}, clip, sigma, seed=5, method="m")
    assert float(out.uplink["w"].std()) == pytest.approx(sigma * clip, rel=0.01)
    # seeded: the same seed draws the same noise (a resumed round), another seed other noise
    again = DP.privatise(local, x, {"w": torch.zeros(200_000)}, clip, sigma, seed=5, method="m")
    other = DP.privatise(local, x, {"w": torch.zeros(200_000)}, clip, sigma, seed=6, method="m")
    assert torch.equal(out.uplink["w"], again.uplink["w"]) and not torch.equal(
        out.uplink["w"], other.uplink["w"]
    )


def test_the_server_clips_a_decoded_update_beyond_the_bound_again():
    """What a lossy uplink decodes to can exceed C (rounding, error feedback's residual):
    the server cuts it back to C in its own direction before the noise, and leaves an
    update within C as it is (user mode; sigma 0 so that the mean shows the updates)."""
    clip = 0.5
    p = PrivacyConfig(mode="user", noise_multiplier=0.0, clip=clip)
    x = state(0)
    over = {n: t + 2 * d for (n, t), d in zip(x.items(), state(1, 0.3).values(), strict=True)}
    within = {n: t + d for (n, t), d in zip(x.items(), state(2, 1e-3).values(), strict=True)}
    raw = DP.update_of(over, x, "m")
    assert DP.norm(raw) > clip
    restated, record, _ = DP.server_side(p, [FitResult(over, {}, 1), FitResult(within, {}, 1)], [x, x],
                                         [True, True], clip, 2, 0.0, seed=0)  # fmt: skip
    cut = DP.update_of(restated[0].uplink, x, "m")
    assert DP.norm(cut) == pytest.approx(clip, rel=1e-5)
    for name in raw:  # the direction kept
        torch.testing.assert_close(cut[name], raw[name] * clip / DP.norm(raw), rtol=1e-5, atol=1e-6)
    assert restated[1].uplink is within and record["reclipped"] == 1


@pytest.mark.slow  # a few runs: out of the default tier for its 10 minutes (CI's slow tier runs it)
def test_a_private_run_with_top_k_and_error_feedback_stays_within_the_bound(tiny_config):
    """User mode with a top-k uplink and its error feedback: the residual makes a client
    send more than it clipped, and the server's second clip keeps every noised sum's
    inputs within C (its records count the cuts)."""
    cfg = tiny_config(**{"train.rounds": 4, "partition.num_clients": 2,
                         "privacy": {"mode": "user", "noise_multiplier": 0.0, "clip": 1e-3},
                         "comm.uplink": {"codec": "topk", "fraction": 0.05}})  # fmt: skip
    run(cfg)
    records = read_records(cfg.output_dir)
    assert sum(r["privacy"]["reclipped"] for r in records) > 0
    assert all(r["privacy"]["reclipped"] <= len(r["clients"]) for r in records)


def test_adaptive_clippings_count_is_centred_as_the_papers():
    """Each client counts ``b - 1/2`` (one added or removed moves the sum by 1/2): three of
    four asked returned, two within the bound: share (1/2 - 1/2 + 1/2) / 4 + 1/2 = 0.625,
    and the bound moves by exp(-clip_lr (0.625 - target))."""
    p = PrivacyConfig(mode="user", noise_multiplier=0.0, clip=1.0, adaptive_clip=True, clip_lr=0.2,
                      target_quantile=0.5)  # fmt: skip
    x = {"w": torch.zeros(3)}
    results = [FitResult({"w": torch.zeros(3)}, {}, 1, cid=i) for i in range(3)]
    _, record, next_clip = DP.server_side(p, results, [x] * 3, [True, False, True], 1.0, 4, 0.0, seed=0)
    assert record["fitted_share"] == pytest.approx(0.625)
    assert next_clip == pytest.approx(math.exp(-0.2 * 0.125))


def test_a_dropped_client_keeps_the_denominator_at_s():
    """Two of three asked clients return: the mean update is their sum over 3, not 2."""
    p = PrivacyConfig(mode="user", noise_multiplier=0.0, clip=100.0)
    x = {"w": torch.zeros(3)}
    results = [FitResult({"w": torch.full((3,), v)}, {}, 1, cid=i) for i, v in enumerate((1.0, 2.0))]
    restated, _, _ = DP.server_side(p, results, [x, x], [True, True], 100.0, 3, 0.0, seed=0)
    mean = torch.stack([r.uplink["w"] for r in restated]).mean(0)
    torch.testing.assert_close(mean, torch.full((3,), 1.0))  # (1 + 2) / 3


@pytest.mark.slow  # 10-12 s: out of the default tier for its 10 minutes (CI's slow tier runs it)
def test_the_accountant_is_the_librarys_rdp_with_replace_one_sampling():
    """Epsilon after T rounds equals dp-accounting's RDP accountant composing the round's
    event T times by hand; local mode has no sampling; sigma 0 spends everything."""
    n, s, sigma, rounds, delta = 20, 5, 1.1, 12, 1e-5
    ours = DP.Accountant("user", n, s, sigma).epsilon(rounds, delta)
    by_hand = dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE
    )
    event = dp_accounting.SampledWithoutReplacementDpEvent(n, s, dp_accounting.GaussianDpEvent(sigma / 2))
    for _ in range(rounds):
        by_hand.compose(event)
    assert ours == pytest.approx(by_hand.get_epsilon(delta), rel=1e-9)
    local = DP.Accountant("local", n, s, sigma).epsilon(rounds, delta)
    plain = dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE
    )
    plain.compose(dp_accounting.GaussianDpEvent(sigma / 2), rounds)
    assert local == pytest.approx(plain.get_epsilon(delta), rel=1e-9)
    assert local > ours  # no amplification by sampling is claimed locally
    assert DP.Accountant("user", n, s, 0.0).epsilon(1, delta) == math.inf
    # more rounds spend more; a target calibrates sigma to spend it (within the tolerance)
    acc = DP.Accountant("user", n, s, sigma)
    assert acc.epsilon(4, delta) < acc.epsilon(8, delta) < acc.epsilon(12, delta)
    p = PrivacyConfig(mode="user", target_epsilon=8.0, delta=delta)
    calibrated = DP.noise_multiplier(p, n, s, rounds)
    assert DP.Accountant("user", n, s, calibrated).epsilon(rounds, delta) <= 8.0
    assert DP.Accountant("user", n, s, calibrated * 0.98).epsilon(rounds, delta) > 8.0


@pytest.mark.parametrize(
    "mode, weighting",
    [("user", "uniform"), pytest.param("local", "examples", marks=pytest.mark.slow)],
    ids=["user", "local"],
)
def test_without_noise_and_with_a_clip_no_update_reaches_each_mode_is_the_plain_run(
    tiny_config, tmp_path, mode, weighting
):
    """sigma 0 and a clip of 1e9: the records and the final model are the non-private
    run's bit for bit (user mode weighs clients uniformly, as the plain run is told to)."""
    extra = {"server.weighting": weighting, "train.rounds": 3}
    plain = tiny_config(output_dir=str(tmp_path / "plain"), **extra)
    private = tiny_config(
        output_dir=str(tmp_path / "dp"),
        **extra,
        privacy={"mode": mode, "noise_multiplier": 0.0, "clip": 1e9},
    )
    run(plain), run(private)
    a, b = read_records(plain.output_dir), read_records(private.output_dir)
    for ra, rb in zip(a, b, strict=True):
        assert rb["loss"] == ra["loss"] and rb["global"] == ra["global"] and rb["local"] == ra["local"]
        assert rb["privacy"]["clipped"] == 0 and rb["privacy"]["epsilon"] is None  # inf: no bound
    summary = read_summary(private.output_dir)["privacy"]
    assert summary["mode"] == mode and summary["epsilon"] is None
    assert_same_model(plain, private, exact=True)


def assert_same_model(plain, private, exact: bool) -> None:
    """The two runs' last checkpoints hold the same global tensors and the same clients'
    personal tensors: bit for bit, or (``exact`` False) to float32 round-off."""
    same = torch.equal if exact else lambda x, y: torch.allclose(x, y, rtol=1e-4, atol=1e-6)
    ca = C.load_checkpoint(plain.output_dir / "checkpoint.pt", fingerprint(plain))
    cb = C.load_checkpoint(private.output_dir / "checkpoint.pt", fingerprint(private))
    assert ca.server.tensors.keys() == cb.server.tensors.keys() and ca.server.tensors
    for name, t in ca.server.tensors.items():
        assert same(t, cb.server.tensors[name]), name
    assert ca.personal.keys() == cb.personal.keys()
    for cid in ca.personal:
        mine, theirs = ca.personal[cid], cb.personal[cid]
        assert all(same(t, theirs[n]) for n, t in mine.items()), cid


@pytest.mark.slow  # about 10 s: the default tier stays under its 10 minutes (CI's slow tier runs it)
@pytest.mark.parametrize(
    "method", [{"name": "fedlr"}, {"name": "pf2lora", "bilevel": False}], ids=["fedlr", "pf2lora-ablation"]
)
def test_dp_sgd_without_noise_or_a_clip_reached_is_the_plain_run_to_round_off(tiny_config, tmp_path, method):
    """Sample mode, sigma 0 and a clip of 1e9: the same steps, the same model; only to
    float32 round-off, since the step averages per-example gradients (a vmap over the rows)
    where the plain run differentiates the batch's mean loss. DP-SGD draws each batch
    anew (its accountant's sampling) where the plain run deals out passes over the data:
    with a batch of all a client's rows the two draw the same rows. SGD: Adam's step would
    blow round-off in near-zero gradients up to the rate. PF2LoRA's ablation (plain
    gradients at both levels, linear in the rows): its client adapter steps by SGD on the
    rows' mean gradient too (the bilevel step a row is not the batch's: it is not compared)."""
    extra = {"train.rounds": 3, "train.batch_size": 10_000, "train.optimizer": "sgd", "train.lr": 0.5,
             "method": method}  # fmt: skip
    plain = tiny_config(output_dir=str(tmp_path / "plain"), **extra)
    private = tiny_config(
        output_dir=str(tmp_path / "dp"),
        **extra,
        privacy={"mode": "sample", "noise_multiplier": 0.0, "clip": 1e9},
    )
    run(plain), run(private)
    a, b = read_records(plain.output_dir), read_records(private.output_dir)
    for ra, rb in zip(a, b, strict=True):
        assert rb["clients"] == ra["clients"]
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5)
        assert rb["global"] == pytest.approx(ra["global"], rel=1e-5)
    assert read_summary(private.output_dir)["privacy"]["mode"] == "sample"
    assert_same_model(plain, private, exact=False)


@pytest.mark.slow  # 10-12 s: out of the default tier for its 10 minutes (CI's slow tier runs it)
def test_a_private_run_records_epsilon_each_round_and_stays_within_its_budget(tiny_config, tmp_path):
    cfg = tiny_config(
        **{"train.rounds": 4, "privacy": {"mode": "user", "target_epsilon": 8.0, "delta": 1e-4, "clip": 0.05}}
    )
    run(cfg)
    records = read_records(cfg.output_dir)
    spent = [r["privacy"]["epsilon"] for r in records]
    assert spent == sorted(spent) and spent[0] > 0
    assert spent[-1] <= 8.0 and spent[-1] > 7.0  # calibrated to spend the budget, not far under it
    assert all(r["privacy"]["clipped"] >= 1 for r in records)  # a small clip bites
    summary = read_summary(cfg.output_dir)["privacy"]
    assert summary["epsilon"] == spent[-1] and summary["delta"] == 1e-4
    sigma = summary["noise_multiplier"]
    assert DP.Accountant("user", 4, 2, sigma).epsilon(4, 1e-4) == pytest.approx(spent[-1])


def test_a_run_that_would_exceed_its_budget_is_refused_before_it_trains(tiny_config):
    cfg = tiny_config(
        **{"train.rounds": 6, "privacy": {"mode": "user", "noise_multiplier": 0.8, "target_epsilon": 5.0}}
    )
    setup = build(cfg)
    with pytest.raises(ConfigError, match=r"privacy\.target_epsilon 5: .*round \d of train\.rounds 6"):
        make_engine(setup, None)
    # a resumed run asked for more rounds than its budget covers stops before the round over it
    acc = DP.Accountant("user", 4, 2, 0.8)
    first_over = next(r for r in range(1, 7) if acc.epsilon(r, 1e-5) > 5.0)
    with pytest.raises(DP.PrivacyBudgetExceeded, match=rf"round {first_over} would spend"):
        DP.check_budget(cfg.privacy, acc, first_over)
    assert DP.check_budget(cfg.privacy, acc, first_over - 1) <= 5.0


@pytest.mark.slow  # it builds the server's model: the default tier stays under its 10 minutes
def test_a_deployed_run_over_its_budget_is_refused_before_any_round(tiny_config, tmp_path):
    """The Flower server checks the same plan before it asks any node to train."""
    cfg = tiny_config(
        **{"train.rounds": 6, "privacy": {"mode": "user", "noise_multiplier": 0.8, "target_epsilon": 5.0}}
    )
    grid = deploy(cfg, tmp_path)
    with pytest.raises(ConfigError, match=r"privacy\.target_epsilon 5: .*round \d of train\.rounds 6"):
        serve(grid)
    assert not [m for m in grid.sent if m.metadata.message_type == "train"]
    assert not (cfg.output_dir / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "overrides, match",
    [
        *[
            (
                {"server.aggregation": rule, "train.clients_per_round": 5, "partition.num_clients": 6},
                f"server.aggregation {rule} reads the individual updates",
            )
            for rule in ("median", "trimmed_mean", "krum", "multi_krum")
        ],
        ({"method": {"name": "fedamp"}}, "method fedamp: its server weighs .* noises only the sum"),
        ({"train.correction": "scaffold", "train.optimizer": "sgd"}, "train.correction scaffold"),
        ({"privacy.adaptive_clip": True, "privacy.mode": "local"}, "user mode only"),
    ],
    ids=["median", "trimmed_mean", "krum", "multi_krum", "fedamp", "scaffold", "adaptive-local"],
)
def test_what_cannot_go_with_a_privacy_mode_is_refused_naming_it(tiny_config, overrides, match):
    def private(**more):
        return tiny_config(**{"privacy": {"mode": "user", "noise_multiplier": 1.0}}, **more)

    with pytest.raises((ConfigError, ValueError), match=match):
        build(private(**overrides))  # the method checks run where the method is built


@pytest.mark.parametrize(
    "method",
    [
        pytest.param(m, marks=pytest.mark.slow)
        for m in {
            "fedamp": "similarities",
            "hetlora": "norms",
            "flexlora": "products",
            "lorafair": "its correction",
            "fedexlora": "residuals",
        }
    ],
)
def test_local_dp_goes_with_a_server_that_reads_each_update(tiny_config, method):
    """Local DP noises each update before it leaves, so a server that reads them one by one
    (FedAMP's similarities, HETLoRA's norms, FlexLoRA's products, ...) only post-processes
    them: the run trains and spends epsilon; user mode, whose noise is on the sum, is
    refused for the same method."""
    local = {"mode": "local", "noise_multiplier": 1.0, "clip": 0.1}
    cfg = tiny_config(method={"name": method}, privacy=local)
    run(cfg)
    records = read_records(cfg.output_dir)
    assert 0 < records[0]["privacy"]["epsilon"] < records[-1]["privacy"]["epsilon"]
    with pytest.raises(ConfigError, match=f"privacy.mode user: method {method}"):
        build(tiny_config(method={"name": method}, privacy={"mode": "user", "noise_multiplier": 1.0}))


@pytest.mark.parametrize(
    "method, says",
    [
        ("flora", "its clients send a fresh LoRA's factors"),
        ("fdlora", "round 1 uploads each client's personal LoRA"),
    ],
)
def test_local_dp_refuses_an_uplink_that_is_not_an_update(tiny_config, method, says):
    with pytest.raises(ConfigError, match=f"privacy.mode local: method {method}: {says}"):
        build(tiny_config(method={"name": method}, privacy={"mode": "local", "noise_multiplier": 1.0}))


@pytest.mark.slow  # two runs, one killed and resumed
def test_adaptive_clipping_moves_the_bound_and_a_resumed_run_spends_and_clips_the_same(tiny_config, tmp_path):
    extra = {
        "train.rounds": 4,
        "privacy": {
            "mode": "user",
            "noise_multiplier": 0.5,
            "clip": 1e-3,
            "adaptive_clip": True,
            "count_noise": 1.0,
        },
    }
    a, b, (whole, cut) = whole_and_resumed(tiny_config, tmp_path, **extra)
    assert [r["privacy"] for r in a] == [r["privacy"] for r in b]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    clips = [r["privacy"]["clip"] for r in a]
    assert clips[0] == 1e-3 and clips[-1] > clips[0]  # every update exceeds 1e-3: the bound grows
    assert DP.update_noise_multiplier(whole.privacy, 0.5, 2) > 0.5  # the count's noise is paid for


@pytest.mark.slow  # two runs, one killed and resumed
@pytest.mark.parametrize(
    "settings",
    [
        {"mode": "local", "noise_multiplier": 0.3, "clip": 0.05},
        {"mode": "sample", "target_epsilon": 8.0, "clip": 1.0},
    ],
    ids=["local", "sample"],
)
def test_a_resumed_private_run_spends_as_the_uninterrupted_one(tiny_config, tmp_path, settings):
    """Local noise and DP-SGD: killed in round 3 and resumed, the same epsilon every round,
    the same noise drawn (the same losses) and the same final model."""
    extra = {"train.rounds": 4, "privacy": settings}
    a, b, (whole, cut) = whole_and_resumed(tiny_config, tmp_path, **extra)
    assert [r["privacy"] for r in a] == [r["privacy"] for r in b]
    assert (
        all(r["privacy"]["epsilon"] > 0 for r in a)
        and a[0]["privacy"]["epsilon"] < a[-1]["privacy"]["epsilon"]
    )
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert read_summary(whole.output_dir)["privacy"] == read_summary(cut.output_dir)["privacy"]
    assert_same_model(whole, cut, exact=True)


@pytest.mark.parametrize(
    "settings, method",
    [
        ({"mode": "user", "noise_multiplier": 0.7, "clip": 0.05, "adaptive_clip": True, "count_noise": 1.0},
         {"name": "fedlr"}),
        pytest.param({"mode": "local", "noise_multiplier": 0.3, "clip": 0.05}, {"name": "fedlr"},
                     marks=pytest.mark.slow),
        pytest.param({"mode": "user", "noise_multiplier": 0.7, "clip": 0.05}, FEDSB, marks=pytest.mark.slow),
    ],
    ids=["user-adaptive", "local", "fedsb-user"],
)  # fmt: skip
def test_the_flower_path_clips_on_the_nodes_and_noises_as_in_process(tiny_config, tmp_path, settings, method):
    """The same private runs through Flower's ClientApp and ServerApp: the nodes clip (and,
    locally, noise) what they send, the server noises the sum, with the same seeds, so the
    same records (Fed-SB's: its setup round's gradient sums clipped and noised whole); the
    round's clip bound travels in the training message."""
    over = {"privacy": settings, "train.rounds": 3, "method": method}
    a, b, grid, (local, flower) = in_process_and_deployed(tiny_config, tmp_path, **over)
    for ra, rb in zip(a, b, strict=True):
        assert rb["clients"] == ra["clients"] and "dropped" not in rb
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-6)
        assert rb["global"] == pytest.approx(ra["global"], rel=1e-6)
        # a node tells the server whether its update fitted only when adaptive clipping counts it
        expected = {k: v for k, v in ra["privacy"].items() if settings.get("adaptive_clip") or k != "clipped"}
        assert rb["privacy"] == pytest.approx(expected, rel=1e-9)
    trains = [m for m in grid.sent if m.metadata.message_type == "train"]
    clips = [float(m.content["config"]["clip"]) for m in trains]
    assert clips[0] == 0.05 and len(clips) == 2 * 3  # two clients a round, three rounds
    assert (len(set(clips)) > 1) == settings.get("adaptive_clip", False)  # the bound moves only if adaptive
    deployed, inproc = read_summary(flower.output_dir)["privacy"], read_summary(local.output_dir)["privacy"]
    assert deployed["epsilon"] == pytest.approx(a[-1]["privacy"]["epsilon"])
    assert deployed["mode"] == settings["mode"] and deployed.keys() == inproc.keys()
    for key, value in inproc.items():  # delta, noise multiplier, the final epsilon, ...
        assert deployed[key] == (pytest.approx(value, rel=1e-9) if isinstance(value, float) else value), key


def test_poisson_sampling_draws_each_client_with_probability_q():
    draws = [sample_clients(0, r, 50, 10, 0.2) for r in range(1, 401)]
    sizes = [len(d) for d in draws]
    assert sum(sizes) / len(sizes) == pytest.approx(10, rel=0.05)  # S on average
    assert len(set(sizes)) > 3  # not a fixed count
    assert draws == [sample_clients(0, r, 50, 10, 0.2) for r in range(1, 401)]  # seeded
    assert sample_clients(0, 1, list(range(50)), 10, 0.2) == draws[0]  # ids or a count alike


@pytest.mark.parametrize("n, s, sigma, rounds", [(40, 10, 1.0, 25), (100, 20, 1.5, 30), (50, 5, 0.8, 10)])
def test_poisson_user_level_epsilon_agrees_with_opacus(n, s, sigma, rounds):
    """An independent implementation: Opacus's RDP accountant, stepped once a round at
    sample rate S / N, gives the same epsilon to 1 % (its own Renyi orders)."""
    from opacus.accountants import RDPAccountant

    theirs = RDPAccountant()
    for _ in range(rounds):
        theirs.step(noise_multiplier=sigma, sample_rate=s / n)
    ours = DP.Accountant("user", n, s, sigma, poisson=True).epsilon(rounds, 1e-5)
    assert ours == pytest.approx(theirs.get_epsilon(1e-5), rel=1e-2)


def test_user_level_dp_under_poisson_sampling_is_accounted_add_or_remove(tiny_config):
    """q = S / N, the Gaussian of multiplier sigma on a sum that one client moves by C:
    dp-accounting's own Poisson event; a round that draws no client changes nothing."""
    n, s, sigma, rounds, delta = 40, 10, 1.0, 25, 1e-5
    ours = DP.Accountant("user", n, s, sigma, poisson=True).epsilon(rounds, delta)
    library = dp_accounting.rdp.RdpAccountant()  # add/remove-one by default
    library.compose(dp_accounting.PoissonSampledDpEvent(s / n, dp_accounting.GaussianDpEvent(sigma)), rounds)
    assert ours == pytest.approx(library.get_epsilon(delta), rel=1e-9)
    assert ours < DP.Accountant("user", n, s, sigma).epsilon(rounds, delta)  # replace-one: 2C, no Poisson
    # a run: one client a round on average of four; rounds 3 and 4 draw none (seed 3)
    cfg = tiny_config(
        **{
            "train.rounds": 4,
            "train.clients_per_round": 1,
            "train.client_sampling": "poisson",
            "privacy": {"mode": "user", "noise_multiplier": 1.0, "clip": 0.1},
        }
    )
    assert [sample_clients(3, r, 4, 1, 0.25) for r in range(1, 5)] == [[1], [3], [], []]
    run(cfg)
    records = read_records(cfg.output_dir)
    assert [r["clients"] for r in records] == [[1], [3], [], []]
    assert [r.get("skipped") is not None for r in records] == [False, False, True, True]
    assert records[3]["global"] == records[2]["global"] == records[1]["global"]  # nothing moved
    spent = [r["privacy"]["epsilon"] for r in records]
    acc = DP.Accountant("user", 4, 1, 1.0, poisson=True)
    assert spent == pytest.approx([acc.epsilon(r, 1e-5) for r in range(1, 5)], rel=1e-9)


@pytest.mark.slow  # SecAgg+'s protocol, twice: about 30 s
@pytest.mark.parametrize("mode", ["user", "local"])
def test_dp_through_secure_aggregation_is_the_in_process_run_up_to_its_quantisation(
    tiny_config, tmp_path, mode
):
    """SecAgg+ (Flower's protocol, over the in-memory grid) with user-level DP: the nodes
    clip, SecAgg+ sums them at weight 1 each, the server noises the mean it unmasks; local
    DP: the nodes noise too. The global state is the in-process one up to SecAgg+'s
    quantisation; no reply says whether a client's update fitted within the bound."""
    settings = {"mode": mode, "noise_multiplier": 0.8, "clip": 0.05}
    common = {"train.clients_per_round": 4, "train.rounds": 1, "privacy": settings}
    if mode == "local":
        common["server.weighting"] = "examples"
    cfg = tiny_config(output_dir=str(tmp_path / "secure"), **common, **{"deploy.secure_aggregation": True})
    local_cfg = tiny_config(output_dir=str(tmp_path / "inproc"), **common)
    grid = deploy(cfg, tmp_path)
    serve(grid)
    run(local_cfg)
    secure = torch.load(cfg.output_dir / "checkpoint.pt", weights_only=True)["server"]["tensors"]
    plain = torch.load(local_cfg.output_dir / "checkpoint.pt", weights_only=True)["server"]["tensors"]
    for name, value in plain.items():
        torch.testing.assert_close(secure[name], value, atol=1e-5, rtol=0)
    a, b = read_records(local_cfg.output_dir), read_records(cfg.output_dir)
    assert b[0]["secure_aggregation"] and b[0]["clients_returned"] == [0, 1, 2, 3]
    assert b[0]["privacy"]["epsilon"] == pytest.approx(a[0]["privacy"]["epsilon"])
    assert "clipped" not in b[0]["privacy"]
    assert b[0]["loss"] == pytest.approx(a[0]["loss"], rel=1e-6)  # weighed by examples, as in-process
    assert not any("fitted" in dict(m.content.get("fit", {})) for m in grid.replies)


def test_adaptive_clipping_is_refused_with_secure_aggregation(tiny_config):
    with pytest.raises(ConfigError, match="privacy.adaptive_clip: each client's report"):
        build(
            tiny_config(
                **{
                    "deploy.secure_aggregation": True,
                    "privacy": {"mode": "user", "noise_multiplier": 1.0, "adaptive_clip": True},
                }
            )
        )


@pytest.mark.slow  # a calibration, ~5 s: the default tier stays under its 10 minutes (CI runs the slow tier)
def test_calibration_leaves_the_librarys_left_out_orders_unlogged(caplog):
    """dp-accounting warns of every Rényi order it leaves out of a Poisson-sampled bound
    (hundreds per calibration at q = 0.2); leaving one out only loosens the bound, so they
    are not shown, and the multiplier is the library's all the same."""
    p = PrivacyConfig(mode="user", target_epsilon=3.0, clip=1.0)
    with caplog.at_level(logging.WARNING):
        sigma = DP.noise_multiplier(p, 100, 20, 20, poisson=True)
    assert not [r for r in caplog.records if r.name == "absl"]
    assert DP.Accountant("user", 100, 20, sigma, True).epsilon(20, p.delta) == pytest.approx(3.0, rel=1e-3)
