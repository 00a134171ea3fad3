"""Ditto, MOON, FedRep and FedRoD: each method's local step against hand-written math, and
what stays on the client.

The conformance suite (tests/methods/test_conformance.py) and the cohort check (tests/engines/test_cohort.py)
cover the shared invariants; here each paper's own part is checked on the tiny model.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch.func import functional_call

from fedpeft.config import ConfigError
from fedpeft.data.task import make_batch
from fedpeft.engines.local import OWN, RoundContext, run_cohort
from fedpeft.engines.local.step import clip_groups
from fedpeft.experiment import build, run
from fedpeft.methods.base import Job, load_tensors, trainable_params
from fedpeft.methods.ditto import ANCHOR
from fedpeft.methods.fedrod import PERSONAL, balanced_softmax_loss, label_log_prior
from fedpeft.methods.moon import contrastive_loss

# ---------------------------------------------------------------- helpers


def job_of(setup, cid: int, personal=None, seed: int = 11) -> Job:
    """Client ``cid``'s round-1 job from a fresh server (its initial personal state unless given)."""
    method, client = setup.method, setup.clients[cid]
    received = method.downlink(method.init_server(setup.model), cid)
    if personal is None:
        personal = method.init_client(setup.model, setup.initial, client)
    return Job(received, personal, client, seed, context=RoundContext(method.train))


def first_batch(setup, cid: int = 0, rows: int = 8) -> dict:
    return make_batch(setup.clients[cid].train, torch.arange(rows))


def perturbed(tensors: dict, scale: float = 0.05, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {n: t + scale * torch.randn(t.shape, generator=g) for n, t in tensors.items()}


def recorded_run(cfg):
    """Run ``cfg``; returns the setup and every FitResult of the run, in order."""
    setup = build(cfg)
    results, real = [], setup.method.fit_cohort

    def fit_cohort(model, jobs):
        out = real(model, jobs)
        results.extend(out)
        return out

    setup.method.fit_cohort = fit_cohort
    run(cfg, setup=setup)
    return setup, results


def autograd_of(model, tensors: dict, loss_fn) -> tuple[torch.Tensor, dict]:
    """``loss_fn(model)`` with ``tensors`` loaded, and its gradient w.r.t. every trainable tensor."""
    load_tensors(model, tensors)
    params = trainable_params(model)
    model.eval()
    loss = loss_fn(model)
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return loss.detach(), {
        n: g if g is not None else torch.zeros_like(p)
        for (n, p), g in zip(params.items(), grads, strict=True)
    }


def assert_cohort_equals_alone(method, model, jobs) -> None:
    """Jobs trained as one cohort get the rounds they get alone (tests/engines/test_cohort.py's tolerance)."""
    together = method.fit_cohort(model, jobs)
    for job, joint in zip(jobs, together, strict=True):
        (alone,) = method.fit_cohort(model, [job])
        assert joint.metrics["loss"] == pytest.approx(alone.metrics["loss"], rel=1e-5)
        for part in ("uplink", "personal"):
            a, b = getattr(alone, part), getattr(joint, part)
            assert a.keys() == b.keys()
            for key in a:
                torch.testing.assert_close(b[key], a[key], atol=1e-5, rtol=1e-4, msg=key)


# ---------------------------------------------------------------- Ditto


def test_ditto_gradient_is_loss_plus_proximal_term(tiny_config):
    """The step's gradient: ``grad F(w)`` for the global model, ``grad F(v) + lambda (v - w^t)``
    for the personal one; the reported loss is ``F(v)``."""
    # Prepare: v away from w, and w itself moved off the anchor w^t (as mid-round)
    lam = 0.7
    setup = build(tiny_config(method={"name": "ditto", "lam": lam}))
    model, method = setup.model, setup.method
    start = method.cohort_start(model, job_of(setup, 0))
    names = method.model_names()
    params = dict(start.params)
    params.update(perturbed({n: params[n] for n in names}, seed=1))
    params.update(perturbed({OWN + n: params[OWN + n] for n in names}, seed=2))
    batch = first_batch(setup)
    # Execute
    reported, grads = method.step_gradients(model)(params, start.consts, (batch,))
    # Assert: against autograd of the model's own loss, by hand
    w = {n: params[n] for n in names}
    v = {n: params[OWN + n] for n in names}
    anchor = {n: start.consts[ANCHOR + n] for n in names}
    ce = lambda m: m.loss(m(batch["input_ids"], batch["attention_mask"]), batch)  # noqa: E731
    _, g_w = autograd_of(model, w, ce)
    loss_v, g_v = autograd_of(model, v, ce)
    assert set(grads) == set(method.optimised_names())
    for n in names:
        torch.testing.assert_close(grads[n], g_w[n], atol=1e-6, rtol=1e-5, msg=n)
        torch.testing.assert_close(grads[OWN + n], g_v[n] + lam * (v[n] - anchor[n]), atol=1e-6, rtol=1e-5)
    assert float(reported) == pytest.approx(float(loss_v), rel=1e-6)
    # the anchor is the w the client entered the round with
    assert all(torch.equal(anchor[n], start.params[n]) for n in names)
    assert any(not torch.equal(v[n], anchor[n]) for n in names)


@pytest.mark.parametrize("max_grad_norm", [None, 0.05])
def test_ditto_without_penalty_trains_fedavg_and_local_side_by_side(tiny_config, max_grad_norm):
    """``lam: 0``: ``w`` takes FedLR's round from the received model and ``v`` Local-only's
    from the client's own, step for step on the same batches; with gradient clipping too
    (each model clipped on its own, as two optimizers would)."""
    over = {"train.max_grad_norm": max_grad_norm, "train.local_steps": 3}
    ditto = build(tiny_config(method={"name": "ditto", "lam": 0.0}, **over))
    fedlr = build(tiny_config(method={"name": "fedlr"}, **over))
    local = build(tiny_config(method={"name": "local"}, **over))
    own = perturbed(ditto.initial, seed=7)  # a personal model of an earlier round
    (d,) = ditto.method.fit_cohort(ditto.model, [job_of(ditto, 1, {OWN + n: t for n, t in own.items()})])
    (f,) = fedlr.method.fit_cohort(fedlr.model, [job_of(fedlr, 1)])
    (lo,) = local.method.fit_cohort(local.model, [job_of(local, 1, own)])
    assert set(lo.personal) == set(own) == set(f.uplink)
    for n, t in f.uplink.items():
        torch.testing.assert_close(d.uplink[n], t, atol=1e-6, rtol=1e-5)
    for n, t in lo.personal.items():
        torch.testing.assert_close(d.personal[OWN + n], t, atol=1e-6, rtol=1e-5)
    assert any(not torch.equal(d.personal[OWN + n], own[n]) for n in own)  # v trained
    if max_grad_norm is not None:  # the clipping was active: unclipped, FedLR's round differs
        unclipped = build(tiny_config(method={"name": "fedlr"}, **{**over, "train.max_grad_norm": None}))
        (u,) = unclipped.method.fit_cohort(unclipped.model, [job_of(unclipped, 1)])
        assert any(not torch.allclose(u.uplink[n], t, atol=1e-5) for n, t in f.uplink.items())


def is_fedrod_personal(name: str) -> bool:
    return name.startswith(PERSONAL)


@pytest.mark.parametrize(
    "method, second",
    [
        ({"name": "ditto"}, lambda n: n.startswith(OWN)),
        ({"name": "fedrod"}, is_fedrod_personal),
        ({"name": "fedrod", "head": "personal"}, is_fedrod_personal),
        ({"name": "fedkd"}, lambda n: n.startswith("mentor_head.") or ".mentor." in n),
    ],
    ids=["ditto", "fedrod", "fedrod-personal-generic-head", "fedkd"],
)
def test_two_models_are_clipped_each_on_its_own(tiny_config, method, second):
    """Ditto's ``w`` and ``v``, FedRoD's generic model (body and generic head) and personal
    head, FedKD's mentee and mentor: two gradient-clipping groups, one per model."""
    m = build(tiny_config(method=method)).method
    names = m.optimised_names()
    groups = clip_groups(m, {n: torch.zeros(1) for n in names})
    expected = [{n for n in names if not second(n)}, {n for n in names if second(n)}]
    assert all(expected) and sorted(map(set, groups), key=sorted) == sorted(expected, key=sorted)


def test_ditto_personal_model_never_leaves_the_client(tiny_config):
    cfg = tiny_config(method={"name": "ditto"}, **{"partition.num_clients": 3, "train.clients_per_round": 3})
    setup, results = recorded_run(cfg)
    method = setup.method
    assert results and not method.personal_names  # head shared: all of w is shared
    for r in results:
        assert set(r.uplink) == set(method.shared_names)
        assert not any(n.startswith(OWN) for n in r.uplink)
        assert {n.removeprefix(OWN) for n in r.personal if n.startswith(OWN)} == set(method.model_names())
    # a client is scored with its own v, and w beside it
    last = results[-1]
    client = setup.clients[last.cid]
    state = method.eval_state(setup.model, last.uplink, last.personal, client)
    assert all(torch.equal(state[n], last.personal[OWN + n]) for n in method.model_names())
    (glob,) = method.extra_eval_states(setup.model, last.uplink, last.personal, client).values()
    assert all(torch.equal(glob[n], last.uplink[n]) for n in method.shared_names)


def test_ditto_personal_start_options(tiny_config):
    """``initial``: v starts at w^0 whatever the client receives; ``received``: at the
    received w (and before training a client is scored with the global model)."""
    for init in ("initial", "received"):
        setup = build(tiny_config(method={"name": "ditto", "personal_init": init}))
        method = setup.method
        job = job_of(setup, 0)
        job = replace(job, received=perturbed(job.received))  # a later global model
        start = method.cohort_start(setup.model, job)
        expected = setup.initial if init == "initial" else job.received
        assert all(torch.equal(start.params[OWN + n], expected[n]) for n in method.model_names())
        scored = method.eval_state(setup.model, job.received, job.personal, job.client)
        assert all(torch.equal(scored[n], expected[n]) for n in method.model_names())


def test_ditto_runs_on_a_causal_lm_and_vectorises(tiny_config, tiny_decoder):
    """Ditto needs no classification head: instruction tuning on the tiny decoder, clients
    of different step counts trained as one cohort get the rounds they get alone."""
    from tests.helpers.configs import lm_config

    cfg = lm_config(tiny_config, tiny_decoder, method={"name": "ditto"},
                    **{"train.local_steps": None, "train.local_epochs": 1})  # fmt: skip
    setup = build(cfg)
    jobs = [job_of(setup, c, seed=c) for c in range(len(setup.clients))]
    assert len({len(j.client.train) for j in jobs}) > 1
    assert_cohort_equals_alone(setup.method, setup.model, jobs)


# ---------------------------------------------------------------- MOON


def test_moon_contrastive_loss_by_hand():
    torch.manual_seed(0)
    z, z_glob, z_prev, tau = torch.randn(4, 3), torch.randn(4, 3), torch.randn(4, 3), 0.5
    got = contrastive_loss(z, z_glob, z_prev, tau)
    for i in range(4):
        cos = lambda a, b: float(a @ b) / (float(a.norm()) * float(b.norm()))  # noqa: E731
        pos, neg = math.exp(cos(z[i], z_glob[i]) / tau), math.exp(cos(z[i], z_prev[i]) / tau)
        assert float(got[i]) == pytest.approx(-math.log(pos / (pos + neg)), rel=1e-5)
    # the same previous and global model: log 2 whatever z, and nothing to learn from it
    z = z.clone().requires_grad_()
    same = contrastive_loss(z, z_glob, z_glob.clone(), tau)
    torch.testing.assert_close(same, torch.full((4,), math.log(2)))
    (g,) = torch.autograd.grad(same.sum(), z)
    (g_apart,) = torch.autograd.grad(contrastive_loss(z, z_glob, z_prev, tau).sum(), z)
    assert float(g.abs().max()) < 1e-6 < float(g_apart.abs().max())


def test_moon_step_is_ce_plus_mu_contrastive(tiny_config):
    """The step's loss from the model's pooled representations: ``z`` of the trained
    tensors, ``z_glob`` of the received ones, ``z_prev`` of the client's kept ``own.*``."""
    mu, tau = 2.0, 0.3
    setup = build(tiny_config(method={"name": "moon", "mu": mu, "tau": tau}))
    model, method = setup.model, setup.method
    first = job_of(setup, 0)
    body = method.body_names()
    prev = perturbed({n: first.received[n] for n in body}, scale=0.2, seed=3)
    job = replace(first, personal={**first.personal, **{"own." + n: t for n, t in prev.items()}}, seed=0)
    start = method.cohort_start(model, job)
    params = perturbed(start.params, seed=4)  # the model mid-round
    batch = first_batch(setup)
    value, grads = method.step_gradients(model)(params, start.consts, (batch,))

    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        z_glob = functional_call(model, first.received, (ids, mask), {"pooled": True})
        z_prev = functional_call(model, {**first.received, **prev}, (ids, mask), {"pooled": True})

    def by_hand(m):
        z = m(ids, mask, pooled=True)
        ce = torch.nn.functional.cross_entropy(m.head(z), batch["labels"])
        sg = torch.nn.functional.cosine_similarity(z, z_glob, dim=-1) / tau
        sp = torch.nn.functional.cosine_similarity(z, z_prev, dim=-1) / tau
        return ce + mu * (-torch.log(sg.exp() / (sg.exp() + sp.exp()))).mean()

    loss, expected = autograd_of(model, params, by_hand)
    assert float(value) == pytest.approx(float(loss), rel=1e-5)
    for n, g in expected.items():
        torch.testing.assert_close(grads[n], g, atol=1e-6, rtol=1e-4, msg=n)


def test_moon_keeps_its_previous_model_and_vectorises_with_it(tiny_config):
    cfg = tiny_config(method={"name": "moon"}, **{"partition.num_clients": 3, "train.clients_per_round": 3})
    setup, results = recorded_run(cfg)
    method, body = setup.method, setup.method.body_names()
    for r in results:
        assert set(r.uplink) == set(method.shared_names) and not any(n.startswith("own.") for n in r.uplink)
        assert all(torch.equal(r.personal["own." + n], r.uplink[n]) for n in body)  # its trained body
    # a cohort of clients with different previous models (the contrastive term active)
    jobs = []
    for c in range(3):
        job = job_of(setup, c, seed=c)
        own = {"own." + n: t for n, t in perturbed({n: job.received[n] for n in body}, 0.2, seed=c).items()}
        jobs.append(replace(job, personal={**job.personal, **own}))
    assert_cohort_equals_alone(method, setup.model, jobs)


def test_moon_client_joining_later_contrasts_against_its_untrained_model(tiny_config):
    """A client first sampled in round 2 takes the initial model as its previous one (the
    official code's pool holds every client's network, trained or not): its contrastive
    term pushes away from it, where taking the received model would leave it at log 2,
    without a gradient."""
    setup = build(tiny_config(method={"name": "moon"}))
    model, method, client = setup.model, setup.method, setup.clients[1]
    body = method.body_names()
    personal = method.init_client(model, setup.initial, client)
    assert all(torch.equal(personal["own." + n], setup.initial[n]) for n in body)
    later = perturbed({n: setup.initial[n] for n in method.shared_names}, scale=0.2, seed=8)  # round 2's
    start = method.cohort_start(model, Job(later, personal, client, 0, 2, context=RoundContext(method.train)))
    assert all(torch.equal(start.consts["prev." + n], setup.initial[n]) for n in body)
    batch = first_batch(setup, 1)
    value, grads = method.step_gradients(model)(start.params, start.consts, (batch,))
    method.cfg = method.cfg.model_copy(update={"mu": 0.0})
    ce, ce_grads = method.step_gradients(model)(start.params, start.consts, (batch,))
    assert 0 < float(value - ce) < math.log(2) - 1e-3  # z = z_glob, z_prev apart: below log 2
    assert any(not torch.allclose(grads[n], ce_grads[n], atol=1e-7) for n in body)


# ---------------------------------------------------------------- FedRep


def test_fedrep_phases_move_only_their_own_group(tiny_config):
    """With weight decay: the head phase leaves the body bit-identical, the body phase the
    head; each phase keeps its own optimizer state."""
    cfg = tiny_config(method={"name": "fedrep", "head_steps": 3}, **{
        "train.weight_decay": 0.1, "train.local_steps": 2, "train.optimizer_state": "keep"})  # fmt: skip
    setup = build(cfg)
    model, method = setup.model, setup.method
    head, body = method.personal_names, method.shared_names
    assert head == ["head.weight", "head.bias"] and all("lora_" in n for n in body)
    job = job_of(
        setup, 0, personal=perturbed(setup.method.init_client(model, setup.initial, setup.clients[0]))
    )
    job = replace(job, received=perturbed(job.received, seed=5), seed=0)  # nonzero B: decay would show

    method.phase = "head"
    (h,) = run_cohort(model, method, [job])
    assert all(torch.equal(h.uplink[n], job.received[n]) for n in body)
    assert all(not torch.equal(h.personal[n], job.personal[n]) for n in head)
    method.phase = "body"
    (b,) = run_cohort(model, method, [replace(job, received=h.uplink, personal=h.personal, seed=1)])
    method.phase = None
    assert all(torch.equal(b.personal[n], h.personal[n]) for n in head)
    assert all(not torch.equal(b.uplink[n], h.uplink[n]) for n in body)
    steps = {
        n.removeprefix("opt.step."): float(t) for n, t in b.personal.items() if n.startswith("opt.step.")
    }
    assert steps == {**dict.fromkeys(head, 3.0), **dict.fromkeys(body, 2.0)}

    (whole,) = method.fit_cohort(model, [job])  # the two phases as one round
    assert whole.metrics["steps"] == 5.0 and whole.metrics["head_steps"] == 3.0
    assert whole.metrics["body_steps"] == 2.0 and math.isfinite(whole.metrics["head_loss"])


def test_fedrep_head_never_leaves_the_client(tiny_config):
    cfg = tiny_config(method={"name": "fedrep", "head_steps": 2}, **{"partition.num_clients": 3})
    setup, results = recorded_run(cfg)
    assert results and setup.method.global_state(setup.method.init_server(setup.model)) is None
    for r in results:
        assert not any(n.startswith("head.") for n in r.uplink)
        assert {"head.weight", "head.bias"} <= set(r.personal)
    with pytest.raises(ConfigError, match="head"):
        tiny_config(method={"name": "fedrep", "head": "shared"})


# ---------------------------------------------------------------- FedRoD


def test_fedrod_balanced_softmax_by_hand():
    log_prior = label_log_prior(torch.tensor([0, 0, 0, 2]), 3, floor=0.1)
    torch.testing.assert_close(log_prior, torch.tensor([3.0, 0.1, 1.0]).div(4.1).log())
    torch.manual_seed(0)
    logits = torch.randn(3, 3)
    batch = {"labels": torch.tensor([0, 2, 1]), "weight": torch.tensor([1.0, 1.0, 0.0])}  # last row: padding
    shifted = logits + log_prior
    rows = [float(torch.logsumexp(shifted[i], 0) - shifted[i, batch["labels"][i]]) for i in range(2)]
    assert float(balanced_softmax_loss(logits, log_prior, batch)) == pytest.approx(sum(rows) / 2, rel=1e-6)


def test_fedrod_gradients_keep_the_two_parts_apart(tiny_config):
    """Body and generic head: the gradient of the balanced softmax alone; personal head:
    that of CE(g.detach() + p) alone; the reported loss is that CE."""
    setup = build(tiny_config(method={"name": "fedrod"}))
    model, method = setup.model, setup.method
    start = method.cohort_start(model, job_of(setup, 0))
    params = perturbed(start.params, seed=6)  # a nonzero personal head
    batch = first_batch(setup)
    value, grads = method.step_gradients(model)(params, start.consts, (batch,))
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    prior = label_log_prior(setup.clients[0].train.labels, model.head.out_features, 0.1)
    torch.testing.assert_close(start.consts["log_prior"], prior)

    bsm = lambda m: torch.nn.functional.cross_entropy(m.head(m(ids, mask, pooled=True)) + prior, labels)  # noqa: E731
    _, g_generic = autograd_of(model, params, bsm)

    def client_ce(m):
        z = m(ids, mask, pooled=True).detach()
        return torch.nn.functional.cross_entropy(m.head(z).detach() + m.personal_head(z), labels)

    ce, g_personal = autograd_of(model, params, client_ce)
    for n in method.shared_names:
        torch.testing.assert_close(grads[n], g_generic[n], atol=1e-6, rtol=1e-4, msg=n)
    for n in method.personal_names:
        assert n.startswith(PERSONAL)
        torch.testing.assert_close(grads[n], g_personal[n], atol=1e-6, rtol=1e-4, msg=n)
    assert float(value) == pytest.approx(float(ce), rel=1e-6)


def test_fedrod_personal_head_stays_and_predicts_with_the_generic_one(tiny_config):
    cfg = tiny_config(method={"name": "fedrod"}, **{"partition.num_clients": 3, "train.clients_per_round": 3})
    setup, results = recorded_run(cfg)
    model, method = setup.model, setup.method
    assert method.personal_names == [PERSONAL + "weight", PERSONAL + "bias"]
    for r in results:
        assert not any(n.startswith(PERSONAL) for n in r.uplink) and "head.weight" in r.uplink
        assert any(float(r.personal[n].abs().max()) > 0 for n in method.personal_names)  # trained from 0
    # the client's model predicts with g + p; the global model with g alone
    r = results[-1]
    client = setup.clients[r.cid]
    batch = make_batch(client.test, torch.arange(min(8, len(client.test))))
    ids, mask = batch["input_ids"], batch["attention_mask"]
    state = {**r.uplink, **method.params_of(r.personal)}
    model.eval()
    with torch.no_grad():
        load_tensors(model, state)
        z = model(ids, mask, pooled=True)
        two_heads = model.head(z) + model.personal_head(z)
        load_tensors(model, method.eval_state(model, r.uplink, r.personal, client))
        torch.testing.assert_close(model(ids, mask), two_heads, atol=1e-5, rtol=1e-5)
    glob = method.global_state(method.init_server(model))
    assert all(float(glob[n].abs().max()) == 0 for n in method.personal_names)
    assert set(method.extra_eval_states(model, r.uplink, r.personal, client)) == {"generic"}


def test_fedrod_head_personal_keeps_the_generic_head_too(tiny_config):
    setup = build(tiny_config(method={"name": "fedrod", "head": "personal"}))
    method = setup.method
    assert set(method.personal_names) == {
        "head.weight",
        "head.bias",
        "personal_head.weight",
        "personal_head.bias",
    }
    assert method.global_state(method.init_server(setup.model)) is None


# ---------------------------------------------------------------- configuration errors


@pytest.mark.parametrize(
    "method, key",
    [
        ({"name": "ditto", "lam": -1.0}, "lam"),
        ({"name": "ditto", "personal_init": "zero"}, "personal_init"),
        ({"name": "moon", "tau": 0.0}, "tau"),
        ({"name": "fedrep", "head_epochs": 0}, "head_epochs"),
        ({"name": "fedrod", "prior_floor": 0.0}, "prior_floor"),
    ],
)
def test_bad_options_are_refused_by_name(tiny_config, method, key):
    with pytest.raises(ConfigError, match=key):
        tiny_config(method=method)
