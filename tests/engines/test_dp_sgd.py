"""Sample-level DP-SGD (issue 34, item 1): per-example gradients inside the cohort's step,
each clipped, Gaussian noise on their sum, batches drawn without replacement, and each
client's epsilon from the library's accountant."""

from __future__ import annotations

import itertools

import dp_accounting
import pytest
import torch

from fedpeft.config import ConfigError
from fedpeft.data.task import Draw
from fedpeft.engines import privacy as DP
from fedpeft.engines.local import Job, RoundContext, SampleDP
from fedpeft.engines.local.attention import eager_attention
from fedpeft.engines.local.dp import dp_noise, private_gradients
from fedpeft.experiment import build, make_engine, run
from fedpeft.flower.deploy import check_deployable
from fedpeft.methods.base import read_tensors
from fedpeft.report.results import read_records, read_summary

ROWS = 6


@pytest.fixture
def step(tiny_config):
    """The tiny model's FedLR gradient function, its trainable tensors and a batch of ROWS rows."""
    setup = build(tiny_config())
    model = setup.model.eval()
    params = read_tensors(model, [n for n, p in model.named_parameters() if p.requires_grad])
    batch = Draw(setup.clients[0].train, torch.arange(ROWS)).batch()
    with eager_attention(model):
        yield setup.method.step_gradients(model), params, batch


def flat_norm(tensors) -> float:
    return float(torch.cat([t.flatten() for t in tensors.values()]).norm())


def test_per_example_gradients_are_a_loop_of_single_example_gradients(step):
    gradients, params, batch = step
    dp = SampleDP(clip=1e9, sigma=0.0, batch=ROWS)  # no clip reached, no noise: the plain mean
    loss, grads = private_gradients(gradients, dp, params, {}, (batch,), {})
    loop = {n: torch.zeros_like(p) for n, p in params.items()}
    losses = []
    for i in range(ROWS):
        value, g = gradients(params, {}, ({k: v[i : i + 1] for k, v in batch.items()},))
        losses.append(float(value))
        loop = {n: loop[n] + g[n] / ROWS for n in loop}
    for name in params:
        torch.testing.assert_close(grads[name], loop[name], rtol=1e-4, atol=1e-7)
    assert float(loss) == pytest.approx(sum(losses) / ROWS, rel=1e-5)
    # and the batch's own gradient (a mean over its rows) is their mean
    _, whole = gradients(params, {}, (batch,))
    for name in params:
        torch.testing.assert_close(grads[name], whole[name], rtol=1e-3, atol=1e-6)


def test_each_examples_gradient_is_clipped_to_c_and_the_noise_is_sigma_c(step):
    gradients, params, batch = step
    one = {k: v[:1] for k, v in batch.items()}
    raw = gradients(params, {}, (one,))[1]
    clip = flat_norm(raw) / 10
    _, clipped = private_gradients(gradients, SampleDP(clip, 0.0, 1), params, {}, (one,), {})
    assert flat_norm(clipped) == pytest.approx(clip, rel=1e-5)  # cut to C, direction kept
    for name in raw:
        torch.testing.assert_close(clipped[name], raw[name] * (clip / flat_norm(raw)), rtol=1e-4, atol=1e-9)
    # every row clipped: the mean of ROWS gradients of norm C is at most C
    _, mean = private_gradients(gradients, SampleDP(clip, 0.0, ROWS), params, {}, (batch,), {})
    assert flat_norm(mean) <= clip * (1 + 1e-5)
    # the noise: sigma C times a standard normal, on the sum (so sigma C / B on the mean)
    noise = {n: torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) for n, p in params.items()}
    _, noisy = private_gradients(gradients, SampleDP(clip, 2.0, ROWS), params, {}, (batch,), noise)
    added = torch.cat([(noisy[n] - mean[n]).flatten() for n in params])
    assert float(added.std()) == pytest.approx(
        2.0 * clip / ROWS * float(torch.cat([x.flatten() for x in noise.values()]).std()), rel=1e-3
    )


def test_each_per_example_gradient_is_clipped_on_its_own(step):
    """A clip between the rows' gradient norms: the step is the mean of the rows' gradients,
    each taken alone and cut to C alone (those under C untouched), not the batch's gradient
    cut once; every row's clipped norm is at most C; the mean is over the rows drawn."""
    gradients, params, batch = step
    rows = [gradients(params, {}, ({k: v[i : i + 1] for k, v in batch.items()},))[1] for i in range(ROWS)]
    norms = sorted(flat_norm(g) for g in rows)
    clip = (norms[ROWS // 2 - 1] + norms[ROWS // 2]) / 2  # half the rows above C, half under
    clipped = [{n: t * min(1.0, clip / flat_norm(g)) for n, t in g.items()} for g in rows]
    assert sum(flat_norm(g) > clip for g in rows) == ROWS // 2
    assert all(flat_norm(g) <= clip * (1 + 1e-6) for g in clipped)
    _, grads = private_gradients(gradients, SampleDP(clip, 0.0, ROWS), params, {}, (batch,), {})
    for name in params:
        loop = sum(g[name] for g in clipped) / ROWS
        torch.testing.assert_close(grads[name], loop, rtol=1e-4, atol=1e-7)
    # a client of fewer rows than the batch draws them all: their mean, not their sum over
    # the batch size (which would shrink its steps, silently, by rows / batch)
    _, few = private_gradients(gradients, SampleDP(clip, 0.0, 4 * ROWS), params, {}, (batch,), {})
    for name in params:
        torch.testing.assert_close(few[name], grads[name], rtol=1e-6, atol=0.0)
    # a cohort pads a client's batch with rows of weight 0: they add nothing and are not
    # counted (three real rows of six: the mean of those three)
    weighted = {**batch, "weight": torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])}
    _, padded = private_gradients(gradients, SampleDP(clip, 0.0, ROWS), params, {}, (weighted,), {})
    for name in params:
        torch.testing.assert_close(padded[name], sum(g[name] for g in clipped[:3]) / 3, rtol=1e-4, atol=1e-7)
    # which is not the batch's gradient cut to C once
    _, whole = gradients(params, {}, (batch,))
    once = torch.cat([(t * min(1.0, clip / flat_norm(whole))).flatten() for t in whole.values()])
    assert not torch.allclose(torch.cat([grads[n].flatten() for n in params]), once, rtol=1e-3, atol=1e-6)


def test_pf2loras_rows_each_take_a_bilevel_step_clipped_at_both_levels_together(tiny_config):
    """PF2LoRA under DP-SGD: each row's gradient is its own bilevel step's (the upper
    level's hypergradient and the client adapter's gradient, Algorithm 1's one-sample
    step), the two clipped to C as one vector and their mean taken; the client adapter's
    share is bounded and noised like the rest, so nothing a row moves escapes the clip."""
    setup = build(tiny_config(**{"method": {"name": "pf2lora", "lora": {"r": 2}, "client_rank": 1}}))
    model, method = setup.model.eval(), setup.method
    torch.manual_seed(0)
    with torch.no_grad():  # off the B = 0 / D = 0 start, so both levels have gradients
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.add_(0.1 * torch.randn_like(p))
    params = read_tensors(model, [n for n, p in model.named_parameters() if p.requires_grad])
    lower = set(method.lower_names())
    batch = Draw(setup.clients[0].train, torch.arange(ROWS)).batch()
    with eager_attention(model):
        gradients = method.step_gradients(model)
        rows = [gradients(params, {}, ({k: v[i : i + 1] for k, v in batch.items()},))[1] for i in range(ROWS)]
        assert all(set(g) == set(params) and flat_norm({n: g[n] for n in lower}) > 0 for g in rows)
        norms = sorted(flat_norm(g) for g in rows)
        clip = (norms[ROWS // 2 - 1] + norms[ROWS // 2]) / 2
        _, grads = private_gradients(gradients, SampleDP(clip, 0.0, ROWS), params, {}, (batch,), {})
    clipped = [{n: t * min(1.0, clip / flat_norm(g)) for n, t in g.items()} for g in rows]
    for name in params:
        torch.testing.assert_close(grads[name], sum(g[name] for g in clipped) / ROWS, rtol=1e-4, atol=1e-7)
    # the upper level alone under C would not bound a row: the client adapter's share counts
    upper_only = [flat_norm({n: t for n, t in g.items() if n not in lower}) for g in rows]
    assert max(upper_only) < max(norms)
    assert method.sgd_rates() == dict.fromkeys(method.lower_names(), method.cfg.lower_lr)


def test_a_clients_noise_is_its_own_whatever_its_cohort(tiny_config):
    setup = build(tiny_config())
    method = setup.method
    context = RoundContext(method.train, SampleDP(1.0, 1.0, 8))
    params = {"w": torch.zeros(2, 50_000)}  # stacked: two clients' tensors
    a = Job({}, {}, setup.clients[0], seed=11, context=context)
    b = Job({}, {}, setup.clients[1], seed=12, context=context)
    alone = next(dp_noise(context, [a], {"w": torch.zeros(1, 50_000)}, torch.device("cpu")))
    together = next(dp_noise(context, [b, a], params, torch.device("cpu")))
    assert torch.equal(together["w"][1], alone["w"][0])
    assert float(alone["w"].std()) == pytest.approx(1.0, rel=0.02)


def test_dp_sgd_epsilon_is_the_librarys_composition_of_its_steps():
    """The accountant scales one step's RDP by the steps; the library composing the steps
    itself gives the same epsilon; a client of fewer rows (a larger sampled share) spends more."""
    n, b, sigma, steps, delta = 60, 8, 1.3, 40, 1e-5
    library = dp_accounting.rdp.RdpAccountant(list(DP.ORDERS), dp_accounting.NeighboringRelation.REPLACE_ONE)
    event = dp_accounting.SampledWithoutReplacementDpEvent(n, b, dp_accounting.GaussianDpEvent(sigma / 2))
    library.compose(event, steps)
    assert DP.dp_sgd_epsilon(n, b, sigma, steps, delta) == pytest.approx(library.get_epsilon(delta), rel=1e-9)
    assert DP.dp_sgd_epsilon(30, b, sigma, steps, delta) > DP.dp_sgd_epsilon(n, b, sigma, steps, delta)
    plain = dp_accounting.rdp.RdpAccountant(list(DP.ORDERS), dp_accounting.NeighboringRelation.REPLACE_ONE)
    plain.compose(dp_accounting.GaussianDpEvent(sigma / 2), steps)
    assert DP.dp_sgd_epsilon(5, b, sigma, steps, delta) == pytest.approx(plain.get_epsilon(delta), rel=1e-9)


def test_a_step_of_nearly_all_rows_spends_no_more_than_a_step_of_all_rows():
    """The library's bound for a step sampled without replacement is loose as the batch
    nears the rows (here above the unsampled Gaussian's); the accountant takes the smaller
    at each order, so a client's epsilon never grows with its rows and the fewest rows are
    the worst case that calibration plans for."""
    b, sigma, steps, delta = 16, 4.0, 50, 1e-5
    plain = dp_accounting.rdp.RdpAccountant(list(DP.ORDERS), dp_accounting.NeighboringRelation.REPLACE_ONE)
    plain.compose(dp_accounting.GaussianDpEvent(sigma / 2), steps)
    sampled = dp_accounting.rdp.RdpAccountant(list(DP.ORDERS), dp_accounting.NeighboringRelation.REPLACE_ONE)
    sampled.compose(
        dp_accounting.SampledWithoutReplacementDpEvent(17, b, dp_accounting.GaussianDpEvent(sigma / 2)), steps
    )
    assert sampled.get_epsilon(delta) > 1.5 * plain.get_epsilon(delta)  # the loose bound
    spent = [DP.dp_sgd_epsilon(n, b, sigma, steps, delta) for n in (16, 17, 20, 32, 64)]
    assert spent[1] <= plain.get_epsilon(delta) * (1 + 1e-9)
    assert all(more >= fewer * (1 - 1e-9) for more, fewer in itertools.pairwise(spent))
    assert spent[-1] < 0.5 * spent[0]  # far from the whole batch, sampling amplifies as before


def test_a_dp_sgd_run_records_the_most_any_client_spent(tiny_config):
    cfg = tiny_config(
        **{"train.rounds": 3, "privacy": {"mode": "sample", "target_epsilon": 20.0, "clip": 0.5}}
    )
    run(cfg)
    records = read_records(cfg.output_dir)
    setup = build(cfg)
    sizes = {c.cid: len(c.train) for c in setup.clients}
    sigma, rounds_in = records[0]["privacy"]["noise_multiplier"], {}
    for r in records:  # recomputed: two local steps a round, batches of 8
        for c in r["clients"]:
            rounds_in[c] = rounds_in.get(c, 0) + 1
        most = max(DP.dp_sgd_epsilon(sizes[c], 8, sigma, 2 * k, 1e-5) for c, k in rounds_in.items())
        assert r["privacy"]["epsilon"] == pytest.approx(most, rel=1e-9)
    assert 0 < records[0]["privacy"]["epsilon"] < records[-1]["privacy"]["epsilon"] <= 20.0
    # calibrated on the worst case (the fewest rows, every round): it spends the budget
    worst = DP.dp_sgd_epsilon(min(sizes.values()), 8, sigma, 3 * 2, 1e-5)
    assert 19.0 < worst <= 20.0
    assert read_summary(cfg.output_dir)["privacy"]["mode"] == "sample"


@pytest.mark.slow  # a few runs: out of the default tier for its 10 minutes (CI's slow tier runs it)
@pytest.mark.parametrize("method", {"fedrep": "head, then body", "fdlora": "stage 1 on top of stage 2"})
def test_every_phase_of_a_round_is_charged(tiny_config, method):
    """FedRep's head steps precede its body's, FDLoRA's personal LoRA trains in a client's
    first round on top of stage 2: DP-SGD's accountant charges them all (a client of
    ``n`` rows, ``k`` rounds trained)."""
    from fedpeft.methods.base import local_steps

    over = {"method": {"name": method, "head_steps": 3} if method == "fedrep" else {"name": method,
            "personal_steps": 4}}  # fmt: skip
    setup = build(tiny_config(**{"privacy": {"mode": "sample", "noise_multiplier": 1.0}}, **over))
    engine = make_engine(setup, None)
    n = len(setup.clients[0].train)
    k = local_steps(n, setup.method.train)
    every, once = (3 + k, 0) if method == "fedrep" else (k, 4)
    accountant = engine.rounds.sample_accountant  # the round pipeline's, built from the clients
    assert accountant.steps_over(0, 1) == every + once and accountant.steps_over(0, 5) == 5 * every + once
    by_hand = DP.dp_sgd_epsilon(n, 8, 1.0, 2 * every + once, 1e-5)
    assert accountant.spent({0: 2}, 1e-5) == pytest.approx(by_hand)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"method": {"name": "adamix"}}, "method adamix draws its own batches"),
        ({"data.task": "causal_lm"}, "not for data.task causal_lm"),
    ],
    ids=["adamix", "causal-lm"],
)
def test_what_dp_sgd_cannot_take_is_refused_naming_it(tiny_config, overrides, match):
    with pytest.raises(ConfigError, match=match):
        build(tiny_config(**{"privacy": {"mode": "sample", "noise_multiplier": 1.0}}, **overrides))


@pytest.mark.slow  # an in-process run and two deployed ones
@pytest.mark.parametrize("secure", [False, True], ids=["plain", "secagg"])
def test_dp_sgd_deployed_steps_and_accounts_as_in_process(tiny_config, tmp_path, secure):
    """``privacy.mode sample`` through Flower's ServerApp and ClientApp (and SecAgg+): the
    server calibrates the noise multiplier on the clients' sizes from the roll call, as
    in-process on the partition, sends it with every training message and keeps it in its
    state; the nodes step DP-SGD with it (the same batches and noise), so the records,
    epsilon included, are the in-process run's."""
    from tests.helpers.flower import deploy, serve

    over = {"train.rounds": 2, "privacy": {"mode": "sample", "target_epsilon": 5.0, "clip": 0.5}}
    check_deployable(tiny_config(**over))
    local = tiny_config(output_dir=str(tmp_path / "inproc"), **over)
    flower = tiny_config(output_dir=str(tmp_path / "flower"), **over, **{"deploy.secure_aggregation": secure})
    run(local)
    grid = deploy(flower, tmp_path)
    serve(grid)
    a, b = read_records(local.output_dir), read_records(flower.output_dir)
    for ra, rb in zip(a, b, strict=True):
        assert rb["clients_returned"] == ra["clients"] and "dropped" not in rb
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5)
        assert rb["global"]["accuracy"] == pytest.approx(ra["global"]["accuracy"], abs=1e-9)
        assert rb["privacy"] == pytest.approx(ra["privacy"], rel=1e-9)
    sigma = a[-1]["privacy"]["noise_multiplier"]
    assert 0 < a[-1]["privacy"]["epsilon"] <= 5.0
    server = torch.load(flower.output_dir / "checkpoint.pt", weights_only=True)["server"]
    assert float(server["extras"][DP.SIGMA]) == pytest.approx(sigma, rel=1e-6)  # kept for a resume
    if not secure:
        trains = [m for m in grid.sent if m.metadata.message_type == "train"]
        assert [float(m.content["config"]["dp_sigma"]) for m in trains] == pytest.approx([sigma] * 4)


def test_a_deployed_client_whose_rows_would_overspend_refuses_to_train():
    """The server calibrates on the clients it knows; a client of fewer rows would spend
    more at that noise, so it checks its own plan and refuses, naming its rows."""
    p = DP.PrivacyConfig(mode="sample", target_epsilon=3.0, delta=1e-5)
    sigma = DP.sample_accountant(p, {0: 400}, {0: 5}, 16, 10).sigma
    DP.check_client_plan(p, 400, (5, 0), 16, sigma, 10)  # the client it was calibrated on
    with pytest.raises(DP.PrivacyBudgetExceeded, match="this client's 40 training rows"):
        DP.check_client_plan(p, 40, (5, 0), 16, sigma, 10)


@pytest.mark.slow  # two runs, one of them vmapped over clients and rows
@pytest.mark.parametrize("method", {"fedlr": "plain LoRA", "pf2lora": "a bilevel step a row"})
def test_a_clients_dp_sgd_round_does_not_depend_on_its_cohort(tiny_config, tmp_path, method):
    """Two clients vmapped together (rows vmapped inside) train as each alone does: the
    same batches, noise and clipping, to float rounding (PF2LoRA: a bilevel step a row)."""
    private = {"train.rounds": 2, "method.name": method,
               "privacy": {"mode": "sample", "noise_multiplier": 1.0, "clip": 0.5}}  # fmt: skip
    alone = tiny_config(output_dir=str(tmp_path / "alone"), **private, **{"train.cohort_size": 1})
    together = tiny_config(output_dir=str(tmp_path / "together"), **private, **{"train.cohort_size": 2})
    run(alone), run(together)
    a, b = read_records(alone.output_dir), read_records(together.output_dir)
    for ra, rb in zip(a, b, strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-4)
        assert rb["global"]["accuracy"] == pytest.approx(ra["global"]["accuracy"], abs=1e-9)
        assert rb["privacy"] == ra["privacy"]


def test_a_deployed_client_refuses_less_noise_than_its_own():
    """With ``privacy.noise_multiplier`` set and no budget, a client steps at the server's
    noise multiplier only if it is at least its own: a server cannot turn its noise off."""
    p = DP.PrivacyConfig(mode="sample", noise_multiplier=1.0)
    DP.check_client_plan(p, 40, (5, 0), 16, 1.0, 10)
    DP.check_client_plan(p, 40, (5, 0), 16, 2.0, 10)  # more noise than asked: its choice to accept
    with pytest.raises(DP.PrivacyBudgetExceeded, match=r"noise multiplier 0\.5, .*client's own"):
        DP.check_client_plan(p, 40, (5, 0), 16, 0.5, 10)


@pytest.mark.slow  # two deployed runs, one killed in its last round and resumed
def test_a_resumed_deployment_accounts_for_clients_whose_nodes_are_not_back(tiny_config, tmp_path):
    """A DP-SGD deployment killed in round 3 and resumed with client 3's node gone: the
    server kept every client's rows with its state, so round 3's epsilon is the most any
    client spent, client 3's two rounds counted at its rows."""
    from tests.helpers.flower import deploy, serve
    from tests.helpers.runs import Killed

    cfg = tiny_config(**{"train.rounds": 3, "train.clients_per_round": 4, "deploy.min_nodes": 3,
                         "privacy": {"mode": "sample", "noise_multiplier": 1.0, "clip": 0.5}})  # fmt: skip
    grid = deploy(cfg, tmp_path)

    def killed_in_round_3(node, message):
        if message.metadata.message_type == "train" and message.content["config"]["round"] == 3:
            raise Killed
        return None

    grid.faults = killed_in_round_3
    with pytest.raises(Killed):
        serve(grid)
    assert len(read_records(cfg.output_dir)) == 2
    serve(deploy(cfg, tmp_path, num_nodes=3), resume=True)  # clients 0-2 only
    records = read_records(cfg.output_dir)
    assert [r["clients"] for r in records] == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2]]
    setup = build(cfg)
    sizes = {c: len(client.train) for c, client in enumerate(setup.clients)}
    steps = {c: setup.method.private_steps(n, cfg.train)[0] for c, n in sizes.items()}
    accountant = DP.SampleAccountant(sizes, steps, cfg.train.batch_size, 1.0)
    spent = accountant.spent({0: 3, 1: 3, 2: 3, 3: 2}, cfg.privacy.delta)
    assert records[-1]["privacy"]["epsilon"] == pytest.approx(spent, rel=1e-9)
    server = torch.load(cfg.output_dir / "checkpoint.pt", weights_only=True)["server"]
    assert DP.known_rows(server["extras"]) == sizes
