"""A cohort against its clients one at a time: the jobs of a round and the comparison
(its tolerances: ``tests/engines/test_cohort.py``'s docstring)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from fedpeft.engines.inprocess import derive_seed
from fedpeft.engines.local import Job, RoundContext
from fedpeft.engines.local.attention import eager_attention
from fedpeft.experiment import build, make_engine
from fedpeft.peft.svd import FACTORS, decompress
from fedpeft.report.results import read_records


def assert_cohort_equals_alone(setup, cids, name, jobs=None) -> None:
    """Clients ``cids`` trained as one cohort get the round each gets alone: same steps,
    loss to 1e-5 relative, tensors to 1e-5 but for Adam's noise-driven elements (see the
    module docstring). ``jobs``: their round's jobs (default: round 1's, from a fresh
    server)."""
    lr, adam = setup.cfg.train.lr, setup.cfg.train.optimizer != "sgd"
    jobs = jobs or round_jobs(setup, cids)
    together = setup.method.fit_cohort(setup.model, copy.deepcopy(jobs))
    for cid, joint, job in zip(cids, together, jobs, strict=True):
        with eager_attention(setup.model):  # the cohort's kernel (alone, SDPA: see below)
            (alone,) = setup.method.fit_cohort(setup.model, copy.deepcopy([job]))
        assert joint.metrics["steps"] == alone.metrics["steps"]
        assert joint.metrics["loss"] == pytest.approx(alone.metrics["loss"], rel=1e-5)
        for part in ("uplink", "personal"):
            a, b = encoded(getattr(alone, part)), encoded(getattr(joint, part))
            assert a.keys() == b.keys()
            for key in a:
                noise_bound = 2 * lr * joint.metrics["steps"]  # the module docstring's
                where = f"{name} {cid} {key}"
                if adam and "key.bias" in key:
                    torch.testing.assert_close(b[key], a[key], atol=noise_bound, rtol=0)
                elif adam:
                    assert_close_but_noise_driven(b[key], a[key], noise_bound, where)
                else:
                    torch.testing.assert_close(
                        b[key], a[key], atol=1e-5, rtol=1e-4, msg=lambda m, w=where: f"{w}: {m}"
                    )


def assert_close_but_noise_driven(got, want, bound: float, where: str, share: float = 0.01) -> None:
    """``got`` within 1e-5 (and 1e-4 relative) of ``want`` but for at most ``share`` of its
    elements, ones that Adam moved by float noise: those within ``bound``."""
    far = (got - want).abs() > 1e-5 + 1e-4 * want.abs()
    assert far.float().mean() <= share, f"{where}: {int(far.sum())} of {far.numel()} elements differ"
    torch.testing.assert_close(got, want, atol=bound, rtol=0, msg=lambda m: f"{where}: {m}")


def round_jobs(setup, cids, rnd=1):
    """Round ``rnd``'s jobs of clients ``cids``: what each receives from a fresh server
    (HETLoRA: truncated to the client's own rank) and its initial personal state."""
    method, initial = setup.method, setup.initial
    server = method.init_server(setup.model)
    jobs = []
    for cid in cids:
        client = setup.clients[cid]
        personal = method.init_client(setup.model, initial, client)
        seed = derive_seed(3, rnd, cid)
        jobs.append(
            Job(method.downlink(server, cid), personal, client, seed, context=RoundContext(method.train))
        )
    return jobs


def encoded(tensors: dict) -> dict:
    """What an uplink of SVD factors (FedKD) encodes, the update itself: where singular
    values nearly tie, their vectors turn by much more than a float error of the matrix
    (the SVD is not continuous there), while ``U diag(s) V^T`` does not."""
    if not any(key.endswith(FACTORS) for key in tensors):
        return tensors
    out = decompress(tensors)
    assert out is not None, "a malformed uplink"
    return out


def step_inputs(method, client, steps: int, generator: torch.Generator):
    """Each step's batches of ``method`` for ``client`` in a plain round (no DP-SGD), cut
    one client at a time (what its ``step_gradients`` is given, less the cohort axis)."""
    job = Job({}, {}, client, 0, context=RoundContext(method.train))
    return (tuple(d.batch() for d in draws) for draws in method.step_draws(job, steps, generator))


def jobs_after_round_one(cfg):
    """Round 2's jobs of every client after the engine ran round 1 with 2 of the 4
    clients: those 2 hold their round-1 state (FDLoRA's personal module, FedKD's synced
    version), the other 2 join late, from their initial state."""
    setup = build(cfg)  # a run of 2 rounds, stopped after round 1
    cfg.output_dir.mkdir(parents=True)
    engine = make_engine(setup, None)
    engine.plan = dataclasses.replace(engine.plan, rounds=1)
    engine.run()
    cids = list(range(len(setup.clients)))
    trained = set(read_records(cfg.output_dir)[0]["clients"])
    assert 0 < len(trained) < len(cids)
    return (
        setup,
        cids,
        [engine.job(engine.server, engine.rounds.begin(2, engine.server), cid)[0] for cid in cids],
        trained,
    )
