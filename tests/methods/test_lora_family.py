"""The federated LoRA family of 2024-26 (issue 33; docs/lora_family.md): what each
method trains, sends and never sends, and the exactness its paper claims for its
aggregate (the global model's update of each module equals the weighted mean of the
clients' updates ``s B_k A_k``)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from fedpeft.engines.local import RoundContext
from fedpeft.experiment import build, run
from fedpeft.methods.base import FitResult, Job, ServerState, read_tensors
from fedpeft.methods.capabilities import refusal
from fedpeft.methods.ffalora import frozen_a_names
from fedpeft.methods.rolora import sent_names
from fedpeft.peft.lora import lora_layers
from fedpeft.report.results import read_records
from tests.helpers.cohort import round_jobs
from tests.helpers.configs import FEDSB
from tests.helpers.runs import whole_and_resumed

#: FlexLoRA with clients of ranks 1, 4 and 2 (repeated over the clients) inside r_max = 4
FLEX = {"name": "flexlora", "lora": {"r": 4}, "ranks": [1, 4, 2]}


def module_updates(model, tensors: dict) -> dict[str, torch.Tensor]:
    """``s B A`` of every LoRA module, from ``tensors`` (A or B missing there: the model's)."""
    own = dict(model.named_parameters())
    out = {}
    for name, layer in lora_layers(model).items():
        a, b = (
            tensors.get(f"{name}.lora_{x}.default.weight", own[f"{name}.lora_{x}.default.weight"])
            for x in "AB"
        )
        out[name] = layer.scaling["default"] * b.double() @ a.double()
    return out


def test_ffalora_trains_and_sends_b_only_with_one_a_everywhere(tiny_config, tmp_path):
    """A is frozen, sent once in the join message and never in an update; B (and the
    head) are trained and sent: half of FedLR's LoRA bytes a round."""
    setup = build(tiny_config(method={"name": "ffalora"}))
    method, model = setup.method, setup.model
    fixed = frozen_a_names(model)
    assert fixed and not set(fixed) & set(method.shared_names + method.personal_names)
    assert all("lora_B" in n or n.startswith("head.") for n in method.shared_names)
    server = method.init_server(model)
    assert sorted(method.join_message(server)) == sorted(fixed)
    a_before = read_tensors(model, fixed)
    results = method.fit_cohort(model, round_jobs(setup, [0, 1]))
    assert all(not set(fixed) & set(r.uplink) for r in results)
    assert all(any(not torch.equal(r.uplink[n], server.tensors[n]) for n in r.uplink) for r in results)
    assert all(torch.equal(a_before[n], t) for n, t in read_tensors(model, fixed).items())

    run(tiny_config(method={"name": "ffalora"}, output_dir=str(tmp_path / "ffa")))
    run(tiny_config(method={"name": "fedlr"}, output_dir=str(tmp_path / "lr")))
    ffa, lr = read_records(tmp_path / "ffa"), read_records(tmp_path / "lr")
    head = sum(t.numel() * 4 for n, t in setup.initial.items() if n.startswith("head."))
    per_client = [(r["bytes_up"] / len(r["clients"]) - head) for r in (ffa[0], lr[0])]
    assert per_client[0] == per_client[1] / 2  # B alone: A and B have r x d each here (d_in == d_out)


def test_ffalora_aggregate_is_the_weighted_mean_of_the_clients_updates(tiny_config):
    """FFA-LoRA's exactness (Sun et al., sec. 4): with A shared and fixed,
    ``mean_w(B_k) A = mean_w(B_k A)`` in every module."""
    setup = build(tiny_config(method={"name": "ffalora"}, **{"train.local_steps": 3}))
    method, model = setup.method, setup.model
    server = method.init_server(model)
    results = method.fit_cohort(model, round_jobs(setup, [0, 1, 2]))
    weights = torch.tensor([float(r.num_examples) for r in results], dtype=torch.float64)
    weights /= weights.sum()
    aggregate = method.aggregate(server, results, 1).tensors
    got = module_updates(model, aggregate)
    each = [module_updates(model, r.uplink) for r in results]
    for name, update in got.items():
        want = sum(w * u[name] for w, u in zip(weights, each, strict=True))
        assert float(want.abs().max()) > 0
        torch.testing.assert_close(update, want, rtol=1e-6, atol=1e-9)


@pytest.mark.slow  # a run and two loads; every method's export loads in test_export_load (slow) too
@pytest.mark.parametrize(
    "method",
    [{"name": "ffalora"}, FLEX, {"name": "lorafair"}, {**FLEX, "name": "flora"}, FEDSB, {"name": "rolora"},
     {"name": "fedsalora"}],
    ids=["ffalora", "flexlora", "lorafair", "flora", "fedsb", "rolora", "fedsalora-client"],
)  # fmt: skip
def test_a_plain_lora_export_loads_with_peft(tiny_config, tmp_path, method):
    """FFA-LoRA's export is one HF PEFT LoRA adapter (A frozen, B trained), FlexLoRA's the
    server's rank-r_max approximation of the mean update (clients of mixed ranks),
    LoRA-FAIR's the averaged A with the corrected B, FLoRA's the merged updates as one
    full-rank term, Fed-SB's its fixed A with B R, RoLoRA's the averaged A and B, and a
    FedSA-LoRA client's the averaged A with its own B (``export.personal``): loaded
    onto the pretrained backbone with ``PeftModel.from_pretrained`` each is the trained
    model."""
    from peft import PeftModel
    from transformers import AutoModel

    import fedpeft

    personal = method["name"] == "fedsalora"  # its B lives on the clients: a client's export
    cfg = tiny_config(method=method, **{"train.rounds": 2, "export.personal": personal})
    run(cfg)
    adapter = cfg.output_dir / "adapter" / ("clients/0" if personal else "")
    loaded = fedpeft.load_export(adapter)
    texts = ["a small dog", "to run quickly"]
    base = AutoModel.from_pretrained(cfg.model.backbone)
    peft_model = PeftModel.from_pretrained(base, str(adapter)).eval()
    batch = loaded.tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        theirs = peft_model(**batch).last_hidden_state
        ours = loaded.model.backbone(**batch).last_hidden_state
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # three decoder runs
@pytest.mark.parametrize("name", ["ffalora", "fedsalora", "rolora"])
def test_the_family_trains_on_a_decoder(tiny_config, tiny_decoder, name):
    from tests.helpers.configs import lm_config

    cfg = lm_config(tiny_config, tiny_decoder, method={"name": name}, **{"train.rounds": 2})
    run(cfg)
    records = read_records(cfg.output_dir)
    assert records[-1]["loss"] < records[0]["loss"]


def test_fedsalora_averages_a_and_keeps_b_and_the_head_on_each_client(tiny_config):
    """Only A travels (and is averaged); each client's B and head stay in its personal
    state, so after a round two clients share A and differ in B."""
    setup = build(tiny_config(method={"name": "fedsalora"}, **{"train.local_steps": 3}))
    method, model = setup.method, setup.model
    assert method.shared_names and all(".lora_A." in n for n in method.shared_names)
    assert all(".lora_B." in n or n.startswith("head.") for n in method.personal_names)
    server = method.init_server(model)
    results = method.fit_cohort(model, round_jobs(setup, [0, 1]))
    for r in results:
        assert set(r.uplink) == set(method.shared_names)
        assert not {n for n in r.personal if ".lora_B." in n or n.startswith("head.")} & set(r.uplink)
    b = next(n for n in method.personal_names if ".lora_B." in n)
    assert not torch.equal(results[0].personal[b], results[1].personal[b])
    weights = torch.tensor([float(r.num_examples) for r in results], dtype=torch.float64)
    aggregate = method.aggregate(server, results, 1).tensors
    for name in method.shared_names:
        want = sum(w * r.uplink[name].double() for w, r in zip(weights / weights.sum(), results, strict=True))
        torch.testing.assert_close(aggregate[name].double(), want, rtol=1e-6, atol=1e-9)
    assert method.global_state(server) is None  # no single global model: each client's own B


def test_rolora_trains_and_sends_b_then_a_in_turn(tiny_config):
    """Round 1 trains and sends B (A frozen), round 2 A (B frozen), with the head each
    round; the server averages the half it got and keeps the other as it was, so each
    round's aggregate is exactly the weighted mean of the clients' updates ``s B_k A_k``."""
    setup = build(tiny_config(method={"name": "rolora"}, **{"train.local_steps": 3}))
    method, model = setup.method, setup.model
    server = method.init_server(model)
    for rnd, trained, frozen in ((1, ".lora_B.", ".lora_A."), (2, ".lora_A.", ".lora_B.")):
        jobs = [
            replace(j, received=method.downlink(server, j.client.cid), rnd=rnd)
            for j in round_jobs(setup, [0, 1, 2], rnd)
        ]
        results = method.fit_cohort(model, jobs)
        for r in results:
            assert any(trained in n for n in r.uplink) and not any(frozen in n for n in r.uplink)
            assert any(n.startswith("head.") for n in r.uplink)
            assert all(not torch.equal(t, server.tensors[n]) for n, t in r.uplink.items() if trained in n)
        weights = torch.tensor([float(r.num_examples) for r in results], dtype=torch.float64)
        weights /= weights.sum()
        new = method.aggregate(server, results, rnd)
        assert all(torch.equal(new.tensors[n], server.tensors[n]) for n in server.tensors if frozen in n)
        each = [module_updates(model, {**server.tensors, **r.uplink}) for r in results]
        for name, update in module_updates(model, new.tensors).items():
            want = sum(w * u[name] for w, u in zip(weights, each, strict=True))
            torch.testing.assert_close(update, want, rtol=1e-6, atol=1e-9)
        server = new


@pytest.mark.parametrize(
    "name",
    [
        "fedlr",
        pytest.param("ffalora", marks=pytest.mark.slow),
        pytest.param("federa", marks=pytest.mark.slow),
        pytest.param("rolora", marks=pytest.mark.slow),
        pytest.param("fedsalora", marks=pytest.mark.slow),
        pytest.param("lorafair", marks=pytest.mark.slow),
        pytest.param("flexlora", marks=pytest.mark.slow),
        pytest.param("hetlora", marks=pytest.mark.slow),
    ],
)
def test_dora_trains_its_magnitudes_cohorts_and_exports_for_peft(tiny_config, name):
    """``lora.use_dora``: the magnitudes train and travel with the adapters (RoLoRA's in
    both of its rounds), a cohort gets each client's round alone, and the export (A, B and
    magnitudes, ``use_dora`` in its config; a FedSA-LoRA client's, whose B is its own)
    loaded with ``PeftModel.from_pretrained`` is the trained model."""
    from peft import PeftModel
    from transformers import AutoModel

    import fedpeft
    from tests.helpers.cohort import assert_cohort_equals_alone

    personal = name == "fedsalora"  # its B lives on the clients: a client's export
    over = {"train.rounds": 2, "export.personal": personal}
    method = {"name": name, "lora": {"use_dora": True}}
    if name in ("flexlora", "hetlora"):  # clients of ranks 2, 8 and 4: the magnitudes beside padded factors
        method = {**method, "lora": {"r": 8, "use_dora": True}, "ranks": [2, 8, 4]}
    cfg = tiny_config(method=method, **over)
    setup = build(cfg)
    magnitudes = [n for n in setup.method.shared_names if "lora_magnitude_vector" in n]
    assert magnitudes
    shared = dict.fromkeys(setup.method.shared_names)
    assert all(set(magnitudes) <= set(setup.method.uplink_like(rnd, shared, {})) for rnd in (1, 2))
    assert_cohort_equals_alone(setup, [0, 1, 2], f"{name}+dora")
    run(cfg, setup=setup)
    trained = torch.load(cfg.output_dir / "checkpoint.pt", weights_only=True)["server"]["tensors"]
    assert any(not torch.equal(trained[n], setup.initial[n]) for n in magnitudes)
    adapter = cfg.output_dir / "adapter" / ("clients/0" if personal else "")
    loaded = fedpeft.load_export(adapter)
    peft_model = PeftModel.from_pretrained(AutoModel.from_pretrained(cfg.model.backbone), str(adapter)).eval()
    assert peft_model.peft_config["default"].use_dora
    batch = loaded.tokenizer(["a small dog", "to run quickly"], return_tensors="pt", padding=True)
    with torch.no_grad():
        theirs = peft_model(**batch).last_hidden_state
        ours = loaded.model.backbone(**batch).last_hidden_state
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "name, why",
    [
        ("flora", "merges the clients' stacked LoRA"),
        ("fedexlora", "its exactness folds"),
        ("fedsb", "LoRA-SB's start"),
        ("pf2lora", "not defined for DoRA's magnitudes"),
    ],
)
def test_dora_is_refused_where_it_does_not_compose(tiny_config, name, why):
    """Refused before any model is built, naming the method, why, and the methods it
    composes with (every method whose class says so, and only those)."""
    from fedpeft.config import ConfigError
    from fedpeft.methods import REGISTRY

    with pytest.raises(ConfigError, match=f"method.lora.use_dora: not for method {name}: ") as err:
        build(tiny_config(method={"name": name, "lora": {"use_dora": True}}))
    assert why in str(err.value)
    composes = str(err.value).split("DoRA composes with ")[1].split(":")[0].split(", ")
    said = {n for n, cls in REGISTRY.items() if not refusal(cls, "dora")}
    assert set(composes) == said >= {"fedlr", "lorafair", "flexlora"}


def test_fedexlora_folds_the_residual_so_the_global_update_is_exact(tiny_config):
    """After a round, the new frozen weight plus ``s B_bar A_bar`` equals the old frozen
    weight plus the clients' weighted mean ``s B_k A_k`` in every module (FedEx-LoRA's
    exactness), the residual is not zero (the factors' mean alone would have missed it),
    and the frozen weights travel down once a residual has moved them (before, every client
    holds them), never up."""
    setup = build(tiny_config(method={"name": "fedexlora"}, **{"train.local_steps": 3}))
    method, model = setup.method, setup.model
    server = method.init_server(model)
    frozen = [w for w, _ in method.modules.values()]
    assert set(method.downlink(server, 0)) == set(method.shared_names)
    assert not set(frozen) & set(method.shared_names)
    results = method.fit_cohort(model, round_jobs(setup, [0, 1, 2]))
    assert all(not set(frozen) & set(r.uplink) for r in results)
    weights = torch.tensor([float(r.num_examples) for r in results], dtype=torch.float64)
    weights /= weights.sum()
    new = method.aggregate(server, results, 1).tensors
    assert set(method.downlink(ServerState(new), 0)) == set(frozen) | set(method.shared_names)
    for name, (w, scale) in method.modules.items():
        a, b = f"{name}.lora_A.default.weight", f"{name}.lora_B.default.weight"
        got = new[w].double() + scale * new[b].double() @ new[a].double()
        mean = sum(
            p * scale * r.uplink[b].double() @ r.uplink[a].double()
            for p, r in zip(weights, results, strict=True)
        )
        want = server.tensors[w].double() + mean
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert float((new[w] - server.tensors[w]).abs().max()) > 0


@pytest.mark.slow  # two runs and two loads
def test_fedexlora_counts_the_frozen_weights_it_sends_and_exports_one_peft_adapter(tiny_config, tmp_path):
    from peft import PeftModel
    from transformers import AutoModel

    import fedpeft

    cfg = tiny_config(method={"name": "fedexlora"}, **{"train.rounds": 2})
    run(cfg)
    lr = tiny_config(method={"name": "fedlr"}, **{"train.rounds": 2}, output_dir=str(tmp_path / "lr"))
    run(lr)
    setup = build(cfg)
    frozen = sum(t.numel() * 4 for t in setup.method.pretrained.values())
    ours, theirs = read_records(cfg.output_dir), read_records(lr.output_dir)
    for a, b in zip(ours, theirs, strict=True):
        assert a["bytes_up"] == b["bytes_up"]  # the factors and the head, as FedLR
        folded = a["round"] > 1  # round 1's clients hold the pretrained weights
        assert a["bytes_down"] == b["bytes_down"] + folded * frozen * len(a["clients"])
    adapter = cfg.output_dir / "adapter"
    loaded = fedpeft.load_export(adapter)
    peft_model = PeftModel.from_pretrained(AutoModel.from_pretrained(cfg.model.backbone), str(adapter)).eval()
    batch = loaded.tokenizer(["a small dog", "to run quickly"], return_tensors="pt", padding=True)
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.model.backbone(**batch).last_hidden_state,
            peft_model(**batch).last_hidden_state,
            rtol=1e-5,
            atol=1e-5,
        )


@pytest.mark.parametrize(
    "over, says",
    [
        ({"server.optimizer": "fedadam"}, "server.optimizer"),
        ({"server.aggregation": "median"}, "server.aggregation"),
        ({"privacy": {"mode": "user", "noise_multiplier": 1.0}}, "privacy.mode"),
    ],
)
def test_fedexlora_refuses_what_would_break_its_exactness(tiny_config, over, says):
    from fedpeft.config import ConfigError

    with pytest.raises(ConfigError, match=says):
        build(tiny_config(method={"name": "fedexlora"}, **over))


def test_flexlora_sends_each_client_its_rank_of_the_svd_of_the_mean_update(tiny_config):
    """FlexLoRA (Bai et al., 2024): each client sends ``A_k, B_k`` at its own rank; the
    server's state is the best rank-``r_max`` approximation of ``sum_k p_k s B_k A_k``, and
    client ``k`` receives its first ``r_k`` terms, which equal a rank-``r_k`` SVD of that
    mean done here by hand (numpy, float64)."""
    import numpy as np

    setup = build(tiny_config(method=FLEX, **{"train.local_steps": 3}))
    method, model = setup.method, setup.model
    server = method.init_server(model)
    ranks = [method.rank(c) for c in range(3)]
    assert ranks == [1, 4, 2]
    results = method.fit_cohort(model, round_jobs(setup, [0, 1, 2]))
    for r, rank in zip(results, ranks, strict=True):
        assert set(r.uplink) == set(method.shared_names)  # every factor and the head; nothing else
        assert {t.shape[0] for n, t in r.uplink.items() if ".lora_A." in n} == {rank}
        assert {t.shape[1] for n, t in r.uplink.items() if ".lora_B." in n} == {rank}
    weights = np.array([r.num_examples for r in results], dtype=float)
    weights /= weights.sum()
    new = method.aggregate(server, results, 1)
    for cid, rank in enumerate(ranks):
        got = module_updates(
            model, method.eval_state(model, method.downlink(new, cid), {}, setup.clients[cid])
        )
        assert set(method.downlink(new, cid)) == set(method.shared_names)
        assert {t.shape[0] for n, t in method.downlink(new, cid).items() if ".lora_A." in n} == {rank}
        for name, (a, b, scale) in method.modules.items():
            mean = sum(
                w * scale * r.uplink[b].double().numpy() @ r.uplink[a].double().numpy()
                for w, r in zip(weights, results, strict=True)
            )
            u, s, vt = np.linalg.svd(mean)
            want = (u[:, :rank] * s[:rank]) @ vt[:rank]
            assert np.linalg.matrix_rank(mean) > rank  # the truncation drops something
            np.testing.assert_allclose(got[name].numpy(), want, rtol=1e-5, atol=1e-7)


def test_flexlora_refuses_a_rank_above_r_max_and_server_steps(tiny_config):
    from fedpeft.config import ConfigError

    with pytest.raises(ConfigError, match=r"method.ranks: rank 8 .* raise it to at least 8"):
        build(tiny_config(method={**FLEX, "ranks": [2, 8]}))
    with pytest.raises(ConfigError, match="server.optimizer"):
        build(tiny_config(method=FLEX, **{"server.optimizer": "fedadam", "server.lr": 0.1}))


def test_the_rank_setting_is_one_for_hetlora_flexlora_and_flora(tiny_config):
    """``method.ranks`` gives HETLoRA, FlexLoRA and FLoRA the same clients at the same ranks:
    a list repeated over the clients, or a seeded draw (HETLoRA's default: uniform in
    ``r_min..r_max`` seeded by ``rank_seed``, the draw it always made)."""
    import numpy as np

    for ranks in ([3, 1], {"choice": [1, 2, 4], "seed": 5}, {"uniform": [1, 4], "seed": 2}):
        het = build(
            tiny_config(method={"name": "hetlora", "lora": {"r": 4}, "r_min": 1, "ranks": ranks})
        ).method
        flex = build(tiny_config(method={**FLEX, "ranks": ranks})).method
        flora = build(tiny_config(method={"name": "flora", "lora": {"r": 4}, "ranks": ranks})).method
        expected = [het.initial_rank(c) for c in range(6)]
        assert expected == [flex.rank(c) for c in range(6)] == [flora.rank(c) for c in range(6)]
        assert len(set(expected)) > 1
    assert [flex.rank(c) for c in range(4)] == [
        np.random.default_rng([flex.seed, 2, c]).integers(1, 5) for c in range(4)
    ]
    default = build(
        tiny_config(method={"name": "hetlora", "lora": {"r": 4}, "r_min": 1, "rank_seed": 3})
    ).method
    assert [default.initial_rank(c) for c in range(5)] == [
        np.random.default_rng([default.seed, 3, c]).integers(1, 5) for c in range(5)
    ]


def objective_and_gradient(delta, b_bar, a_bar, target, lam) -> tuple[float, float]:
    """LoRA-FAIR's cosine objective at ``delta`` and the norm of its gradient there."""
    from fedpeft.methods.lorafair import cosine_objective

    delta = delta.clone().requires_grad_(True)
    loss = cosine_objective(delta, b_bar, a_bar, target, lam)
    return float(loss), float(torch.autograd.grad(loss, delta)[0].norm())


def cosine(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x * y).sum() / (x.norm() * y.norm()))


@pytest.mark.parametrize("similarity", ["frobenius", "cosine"])
def test_lorafair_corrects_b_towards_the_mean_update(tiny_config, similarity):
    """LoRA-FAIR (Bian et al., 2025): ``A`` and the head are FedAvg's, ``B`` is ``B_bar + dB``
    with ``dB`` minimising ``D((B_bar + dB) A_bar, sum_k p_k B_k A_k) + lam ||dB||^2``:
    frobenius against the ridge solution computed here by least squares on the stacked
    system ``[A_bar^T; sqrt(lam) I]``; cosine at a stationary point of its objective that
    beats ``dB = 0``. Either way the corrected product is nearer the mean update than
    ``B_bar A_bar``."""
    import numpy as np

    lam = 0.01
    cfg = tiny_config(
        method={"name": "lorafair", "similarity": similarity, "lam": lam}, **{"train.local_steps": 3}
    )
    setup = build(cfg)
    method, model = setup.method, setup.model
    server = method.init_server(model)
    results = method.fit_cohort(model, round_jobs(setup, [0, 1, 2]))
    weights = torch.tensor([float(r.num_examples) for r in results], dtype=torch.float64)
    weights /= weights.sum()
    new = method.aggregate(server, results, 1).tensors
    plain = method.mean([r.uplink for r in results], [r.num_examples for r in results])
    for n, t in plain.items():
        if ".lora_B." not in n:
            assert torch.equal(new[n], t)  # A and the head: FedAvg's
    for a, b in method.modules.values():
        target = sum(
            w * r.uplink[b].double() @ r.uplink[a].double() for w, r in zip(weights, results, strict=True)
        )
        a_bar, b_bar, got = plain[a].double(), plain[b].double(), new[b].double()
        delta = got - b_bar
        assert float(delta.abs().max()) > 0
        if similarity == "frobenius":
            rows = a_bar.shape[0]
            system = np.vstack([a_bar.numpy().T, np.sqrt(lam) * np.eye(rows)])
            rhs = np.vstack([(target - b_bar @ a_bar).numpy().T, np.zeros((rows, b_bar.shape[0]))])
            want = np.linalg.lstsq(system, rhs, rcond=None)[0].T
            np.testing.assert_allclose(delta.numpy(), want, rtol=1e-4, atol=1e-9)
            assert float((got @ a_bar - target).norm()) < float((b_bar @ a_bar - target).norm())
        else:
            (loss, grad), (start_loss, start_grad) = (
                objective_and_gradient(x, b_bar, a_bar, target, lam) for x in (delta, torch.zeros_like(delta))
            )
            assert loss < start_loss
            assert grad < 1e-3 * start_grad  # stationary, up to B's float32 rounding
            assert cosine(got @ a_bar, target) > cosine(b_bar @ a_bar, target)


def test_lorafair_sends_what_fedlr_sends_and_refuses_other_rules(tiny_config):
    from fedpeft.config import ConfigError

    setup = build(tiny_config(method={"name": "lorafair"}, **{"train.local_steps": 2}))
    fair, model, lr = setup.method, setup.model, build(tiny_config(method={"name": "fedlr"})).method
    assert fair.shared_names == lr.shared_names and fair.personal_names == lr.personal_names
    lora = {n for n in fair.shared_names if ".lora_A." in n or ".lora_B." in n}
    assert lora and lora < set(fair.shared_names)  # the factors and the head
    results = fair.fit_cohort(model, round_jobs(setup, [0, 1]))
    for r in results:  # what a client sends: every factor and the head, nothing it keeps
        assert set(r.uplink) == set(fair.shared_names) and not r.personal.keys() & r.uplink.keys()
    server = fair.aggregate(fair.init_server(model), results, 1)
    assert set(fair.downlink(server, 0)) == set(fair.shared_names)
    with pytest.raises(ConfigError, match="server.aggregation"):
        build(tiny_config(method={"name": "lorafair"}, **{"server.aggregation": "median"}))


FLORA = {**FLEX, "name": "flora"}


def test_flora_merges_the_stacked_update_exactly_and_sends_each_client_what_it_lacks(tiny_config):
    """FLoRA (Wang et al., 2024): clients send ``A_k, B_k`` at their own ranks; the server's
    frozen weights move by exactly ``sum_k p_k s B_k A_k`` (the stacks' product); the
    next downlink to a client that trained carries that round's stack (``sum_k r_k (d_in +
    d_out)`` numbers per module, growing with the clients) and the head, and merging it
    gives the client the server's weights; a client that never trained gets the merged
    weights themselves once its stacks would outweigh them."""
    setup = build(tiny_config(method=FLORA, **{"train.local_steps": 3}))
    method, model = setup.method, setup.model
    server = method.init_server(model)
    results = method.fit_cohort(model, round_jobs(setup, [0, 1, 2]))
    for cid, r in enumerate(results):
        r.cid = cid  # as the engine sets it
    for r, rank in zip(results, [1, 4, 2], strict=True):
        assert {t.shape[0] for n, t in r.uplink.items() if ".lora_A." in n} == {rank}
        assert not any(n.startswith(("own.", "base_layer")) or ".base_layer." in n for n in r.uplink)
    weights = torch.tensor([float(r.num_examples) for r in results], dtype=torch.float64)
    weights /= weights.sum()
    new = method.aggregate(server, results, 1)
    for w, a, b, scale in method.modules.values():
        mean = sum(
            p * scale * r.uplink[b].double() @ r.uplink[a].double()
            for p, r in zip(weights, results, strict=True)
        )
        assert float(mean.abs().max()) > 0
        torch.testing.assert_close(
            new.tensors[w].double(), server.tensors[w].double() + mean, rtol=1e-6, atol=1e-6
        )

    down = method.downlink(new, 0)
    stacks = {n: t for n, t in down.items() if n.startswith("stack.")}
    assert stacks and all(n.startswith("stack.1.") for n in stacks)
    per_module = (1 + 4 + 2) * sum(s for s in next(iter(method.pretrained.values())).shape)
    assert sum(t.numel() for t in stacks.values()) == per_module * len(method.modules)
    assert set(down) == set(stacks) | {n for n in method.shared_names if n.startswith("head.")}
    merged, done = method.frozen_weights(down, results[0].personal)
    assert done == 1
    for w, t in merged.items():
        torch.testing.assert_close(t, new.tensors[w], rtol=1e-6, atol=1e-6)
    # and client 0 (rank 1) starts round 2 from a fresh LoRA on the merged weights: B zero,
    # A drawn anew at its rank (not the A it trained), zero past it
    start = method.cohort_start(
        model, Job(down, results[0].personal, setup.clients[0], seed=2, context=RoundContext(method.train))
    )
    for w, a, b, _ in method.modules.values():
        torch.testing.assert_close(start.params[w], new.tensors[w], rtol=1e-6, atol=1e-6)
        assert not start.params[b].any() and not start.params[a][1:].any()
        assert start.params[a][:1].abs().min() > 0 and not torch.equal(
            start.params[a][:1], results[0].uplink[a]
        )

    late = len(setup.clients) - 1
    assert late > 2  # has never trained
    far = new
    for rnd in range(2, 40):  # rounds of three clients, until a newcomer's stacks outweigh the weights
        far = method.aggregate(far, results, rnd)
        if "merged.round" in method.downlink(far, late):
            break
    down = method.downlink(far, late)
    assert float(down["merged.round"]) == rnd and not any(n.startswith("stack.") for n in down)
    personal = method.init_client(model, setup.initial, setup.clients[late])
    merged, done = method.frozen_weights(down, personal)
    assert done == rnd and all(torch.equal(t, far.tensors[w]) for w, t in merged.items())
    kept = {n for n in far.extras if n.startswith("stack.")}
    assert kept and len(kept) < 2 * len(method.modules) * rnd  # the old stacks are dropped


@pytest.mark.slow  # a few runs: out of the default tier for its 10 minutes (CI's slow tier runs it)
def test_flora_sends_the_stacks_across_a_round_that_drew_no_client(tiny_config):
    """Poisson sampling may draw no client in a round, which then leaves no stack: a
    client that last merged before it still gets the later rounds' stacks (not the dense
    merged weights), and merging them gives the server's weights."""
    setup = build(tiny_config(method=FLORA, **{"train.local_steps": 1}))
    method, model = setup.method, setup.model
    results = method.fit_cohort(model, round_jobs(setup, [0, 1]))
    for cid, r in enumerate(results):
        r.cid = cid
    server = method.aggregate(method.init_server(model), results, 1)  # client 0 has seen nothing
    server = method.aggregate(server, results[1:], 3)  # round 2 drew nobody
    down = method.downlink(server, 0)
    assert not any(n.startswith("merged.") for n in down)
    assert {n.split(".")[1] for n in down if n.startswith("stack.")} == {"1", "3"}
    merged, done = method.frozen_weights(down, method.init_client(model, setup.initial, setup.clients[0]))
    assert done == 3
    for w, t in merged.items():
        torch.testing.assert_close(t, server.tensors[w], rtol=1e-6, atol=1e-6)


def test_fedsb_sets_up_from_the_clients_gradients_then_averages_r_exactly(tiny_config):
    """Fed-SB (Singhal et al., 2025): round 1 is the setup, each client sending the sum of its
    per-example gradients of the full weights (and nothing trained); the server's start is
    LoRA-SB's, ``B = U_r``, ``A = V_r^T``, ``R = diag(S_r) / s`` of ``-lr0 sign(sum_k G_k)``
    (checked against an SVD by hand), so ``s B R A`` is that update's best rank-r
    approximation; then only ``R`` (``r x r``) and the head travel up, ``B`` and ``A`` go
    down once per client, and FedAvg of ``R`` is the exact mean of the clients' updates."""
    import numpy as np

    setup = build(tiny_config(method={**FEDSB, "init_lr": 0.01}, **{"train.local_steps": 3}))
    method, model = setup.method, setup.model
    assert {n for n in method.shared_names if "lora" in n} == {m[3] for m in method.modules.values()}
    server = method.init_server(model)
    jobs = round_jobs(setup, [0, 1, 2])
    assert all(set(j.received) == {"setup.samples"} for j in jobs)
    grads = method.fit_cohort(model, jobs)
    for cid, r in enumerate(grads):
        r.cid = cid
        assert set(r.uplink) == {"grad." + w for w in method.frozen}
        per_client = -(-12 // setup.cfg.train.clients_per_round)  # ceil(init_samples / clients a round)
        assert r.num_examples == min(per_client, len(setup.clients[cid].train))
    started = method.aggregate(server, grads, 1)
    for w, a, b, latent, scale in method.modules.values():
        total = sum(r.uplink["grad." + w].double().numpy() for r in grads)
        u, s, vt = np.linalg.svd(-0.01 * np.sign(total))
        want = (u[:, :4] * s[:4]) @ vt[:4]
        got = (
            scale
            * started.tensors[b].double()
            @ started.tensors[latent].double()
            @ started.tensors[a].double()
        )
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-6)

    down = method.downlink(started, 0)
    assert set(method.fixed) <= set(down)
    results = method.fit_cohort(model, _jobs_from(setup, started, [0, 1, 2]))
    for cid, r in enumerate(results):
        r.cid = cid
        assert set(r.uplink) == set(method.shared_names)
        assert all(r.uplink[m[3]].shape == (4, 4) for m in method.modules.values())
    weights = torch.tensor([float(r.num_examples) for r in results], dtype=torch.float64)
    weights /= weights.sum()
    after = method.aggregate(started, results, 2)
    assert not set(method.fixed) & set(method.downlink(after, 1))  # B and A went down once
    assert set(method.fixed) <= set(method.downlink(after, 3))  # not yet to a client that did not train
    for _, a, b, latent, scale in method.modules.values():
        fixed_b, fixed_a = started.tensors[b].double(), started.tensors[a].double()
        mean = sum(
            p * scale * fixed_b @ r.uplink[latent].double() @ fixed_a
            for p, r in zip(weights, results, strict=True)
        )
        got = scale * fixed_b @ after.tensors[latent].double() @ fixed_a
        torch.testing.assert_close(got, mean, rtol=1e-6, atol=1e-9)


def _jobs_from(setup, server, cids):
    from fedpeft.engines.inprocess import derive_seed
    from fedpeft.engines.local import Job, RoundContext

    method = setup.method
    return [
        Job(method.downlink(server, c), method.init_client(setup.model, setup.initial, setup.clients[c]),
            setup.clients[c], derive_seed(3, 2, c), 2, context=RoundContext(method.train))
        for c in cids
    ]  # fmt: skip


def test_fedsb_refuses_what_would_break_its_start(tiny_config):
    from fedpeft.config import ConfigError

    with pytest.raises(ConfigError, match="server.optimizer"):
        build(tiny_config(method=FEDSB, **{"server.optimizer": "fedadam", "server.lr": 0.1}))


def test_fedsb_setup_round_under_user_level_dp_clips_each_gradient_sum_and_noises_their_sum(tiny_config):
    """``privacy.mode user``: the setup round's gradient sums are messages, not updates of
    what a client received: each is clipped whole to ``C`` (as an update from zero), the
    server adds ``N(0, (sigma C)^2)`` to their sum, and LoRA-SB's start is taken of that
    noised sum (the sign of ``S`` times the restated mean)."""
    import numpy as np

    from fedpeft.config import PrivacyConfig
    from fedpeft.engines import privacy as DP

    setup = build(tiny_config(method={**FEDSB, "init_lr": 0.01}))
    method, model = setup.method, setup.model
    setup_round = {"setup.samples": torch.ones(1)}
    assert method.uplink_messages(setup_round) == ["grad." + w for w in method.frozen]
    assert not method.uplink_messages(method.start)
    p, clip, sigma = PrivacyConfig(mode="user", noise_multiplier=2.0, clip=0.5), 0.5, 2.0
    jobs = round_jobs(setup, [0, 1])
    sums, sent, origins = method.fit_cohort(model, jobs), [], []
    for cid, (job, r) in enumerate(zip(jobs, sums, strict=True)):
        r.cid = cid
        origin = DP.reference(method, job.received, r.uplink)
        assert all(float(origin[n].abs().max()) == 0 for n in r.uplink)
        out = DP.privatise(p, r.uplink, origin, clip, sigma, job.seed, method.name)
        assert DP.norm(r.uplink) > clip and DP.norm(out.uplink) == pytest.approx(clip, rel=1e-5)
        for n, t in r.uplink.items():  # the same direction, scaled down
            torch.testing.assert_close(out.uplink[n], t * (clip / DP.norm(r.uplink)), rtol=1e-4, atol=1e-9)
        sent.append(FitResult(out.uplink, r.personal, r.num_examples, r.metrics, cid))
        origins.append(origin)
    restated, _, _ = DP.server_side(p, sent, origins, [False, False], clip, 2, sigma, seed=11)
    noise = {n: sum(r.uplink[n] for r in restated) - sum(r.uplink[n] for r in sent) for n in sent[0].uplink}
    values = torch.cat([t.flatten() for t in noise.values()])
    assert float(values.std()) == pytest.approx(sigma * clip, rel=0.02)  # on their sum
    started = method.aggregate(method.init_server(model), restated, 1)
    for w, a, b, latent, scale in method.modules.values():
        total = sum(r.uplink["grad." + w].double().numpy() for r in restated)
        u, s, vt = np.linalg.svd(-0.01 * np.sign(total))
        got = (
            scale
            * started.tensors[b].double()
            @ started.tensors[latent].double()
            @ started.tensors[a].double()
        )
        np.testing.assert_allclose(got.numpy(), (u[:, :4] * s[:4]) @ vt[:4], rtol=1e-4, atol=1e-6)


def test_fedsb_setup_round_under_dp_sgd_is_one_clipped_noised_step(tiny_config):
    """``privacy.mode sample``: a client's setup sum is one DP-SGD step's: ``train.batch_size``
    rows, each row's full-weight gradient (all modules as one vector) clipped to ``C``
    (checked against the rows' gradients taken one by one), plus ``N(0, (sigma C)^2)``;
    the accountant charges it as one step more."""
    from fedpeft.engines.local import RoundContext, SampleDP

    setup = build(tiny_config(method=FEDSB, **{"train.batch_size": 4}))
    method, model = setup.method, setup.model
    (job,) = round_jobs(setup, [0])
    assert method.private_steps(len(job.client.train), setup.cfg.train)[1] == 1
    rows = torch.randperm(len(job.client.train), generator=job.generator())[:4]
    per_row = [method.summed_gradients(model, job, row).uplink for row in rows.split(1)]
    norms = [math.sqrt(sum(float(t.double().square().sum()) for t in g.values())) for g in per_row]
    clip = sorted(norms)[1]  # some rows within the bound, some beyond
    want = {
        n: sum(g[n] * min(1.0, clip / size) for g, size in zip(per_row, norms, strict=True))
        for n in per_row[0]
    }
    (quiet,) = method.fit_cohort(
        model, [replace(job, context=RoundContext(method.train, SampleDP(clip, 0, 4)))]
    )
    (noisy,) = method.fit_cohort(
        model, [replace(job, context=RoundContext(method.train, SampleDP(clip, 3, 4)))]
    )
    assert quiet.num_examples == 4
    for n, t in want.items():
        torch.testing.assert_close(quiet.uplink[n], t, rtol=1e-5, atol=1e-7)
    noise = torch.cat([(noisy.uplink[n] - quiet.uplink[n]).flatten() for n in want])
    assert float(noise.std()) == pytest.approx(3.0 * clip, rel=0.02)


@pytest.mark.slow  # two private runs
@pytest.mark.parametrize("mode", ["user", "sample"])
def test_fedsb_trains_under_dp_and_accounts_its_setup_round(tiny_config, mode):
    """A private Fed-SB run sets up, trains ``R`` and records epsilon each round; under
    DP-SGD the setup counts as one step more than the rounds' (the most any client spent)."""
    from fedpeft.engines import privacy as DP

    cfg = tiny_config(method=FEDSB, privacy={"mode": mode, "noise_multiplier": 1.0, "clip": 1.0})
    setup = build(cfg)
    run(cfg, setup=setup)
    records = read_records(cfg.output_dir)
    spent = [r["privacy"]["epsilon"] for r in records]
    assert 0 < spent[0] < spent[-1] and all(math.isfinite(r["loss"]) for r in records)
    if mode == "sample":
        rounds_in: dict[int, int] = {}
        for r in records:
            for c in r["clients"]:
                rounds_in[c] = rounds_in.get(c, 0) + 1
        steps = {c.cid: setup.method.private_steps(len(c.train), setup.cfg.train) for c in setup.clients}
        want = max(
            DP.dp_sgd_epsilon(
                len(setup.clients[c].train), cfg.train.batch_size, 1.0, k * steps[c][0] + 1, cfg.privacy.delta
            )
            for c, k in rounds_in.items()
        )
        assert spent[-1] == pytest.approx(want)


@pytest.mark.slow  # a few runs: out of the default tier for its 10 minutes (CI's slow tier runs it)
@pytest.mark.parametrize("method", ["flora", "fedsb"])
def test_methods_whose_clients_keep_what_they_receive_refuse_a_lossy_downlink(tiny_config, method):
    """FLoRA's clients merge the stacks into their frozen weights, Fed-SB's keep ``B`` and
    ``A``: a rounded copy would stay, so a lossy downlink is refused, naming why; a
    lossless one, and a lossy one for FedLR (a fresh copy each round), build."""
    from fedpeft.config import ConfigError

    with pytest.raises(ConfigError, match=f"comm.downlink int8: method {method}: each client"):
        build(tiny_config(method={"name": method}, **{"comm.downlink.codec": "int8"}))
    build(tiny_config(method={"name": method}, **{"comm.downlink.codec": "none"}))
    build(tiny_config(method={"name": "fedlr"}, **{"comm.downlink.codec": "int8"}))


def test_fedsb_after_its_setup_a_cohort_equals_one_at_a_time(tiny_config):
    """Round 2 (the first that trains R) of clients of different step counts, as one cohort
    and one at a time: the same rounds (test_cohort's tolerances)."""
    from tests.helpers.cohort import assert_cohort_equals_alone

    cfg = tiny_config(method=FEDSB, **{"train.local_steps": None, "train.local_epochs": 1,
                                       "train.optimizer_state": "keep"})  # fmt: skip
    setup = build(cfg)
    method, cids = setup.method, list(range(len(setup.clients)))
    grads = method.fit_cohort(setup.model, round_jobs(setup, cids))
    for cid, r in zip(cids, grads, strict=True):
        r.cid = cid
    started = method.aggregate(method.init_server(setup.model), grads, 1)
    assert_cohort_equals_alone(setup, cids, "fedsb", jobs=_jobs_from(setup, started, cids))


@pytest.mark.slow  # an in-process and a deployed run
def test_fedsb_sets_up_in_the_first_round_that_draws_a_client_on_both_engines(tiny_config, tmp_path):
    """Poisson sampling at seed 4 draws no client in round 1: the setup falls in round 2, and
    the deployed server takes that round's gradient sums (not ``R``) as the replies it
    expects, so both engines give the same records."""
    from fedpeft.engines.round import sample_clients
    from tests.helpers.flower import deploy, serve

    assert not sample_clients(4, 1, 4, 2, 0.5) and sample_clients(4, 2, 4, 2, 0.5)
    over = {"seed": 4, "train.client_sampling": "poisson", "train.rounds": 3, "method": FEDSB}
    local = tiny_config(output_dir=str(tmp_path / "inproc"), **over)
    flower = tiny_config(output_dir=str(tmp_path / "flower"), **over)
    run(local)
    serve(deploy(flower, tmp_path))
    a, b = read_records(local.output_dir), read_records(flower.output_dir)
    assert "skipped" in a[0] and "skipped" in b[0]
    for ra, rb in zip(a[1:], b[1:], strict=True):
        assert rb["clients_returned"] == ra["clients"] and "dropped" not in rb
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-6)
        assert rb["global"] == pytest.approx(ra["global"], rel=1e-6)


@pytest.mark.slow  # about 10 s: the default tier stays under its 10 minutes (CI's slow tier runs it)
def test_fedsb_resumes_after_its_clients_hold_b_and_a_with_the_memory_check_on(
    tiny_config, tmp_path, monkeypatch
):
    """Resumed after every client received ``B`` and ``A`` (so the server sends them no
    more), the memory check probes a client as its next round would pair its downlink and
    the state it holds, and the run ends as the uninterrupted one."""
    import fedpeft.engines.memory as memory

    probed, probe = [], memory._Probe.__init__

    def counted(self, engine, server, measure=None):
        probe(self, engine, server, measure)
        probed.append(engine.method.is_set_up(server))

    monkeypatch.setattr(memory._Probe, "__init__", counted)
    extra = {"method": FEDSB, "train.rounds": 3, "partition.num_clients": 2, "train.memory_check": True}
    a, b, (whole, cut) = whole_and_resumed(tiny_config, tmp_path, **extra)
    # the whole run and the killed one probe the setup round and a round as after it; the
    # resumed one, past the setup, the state it resumes from
    assert probed == [False, True, False, True, True]
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and [r["global"] for r in a] == [
        r["global"] for r in b
    ]


@pytest.mark.slow  # three methods' rounds, each as a cohort and one at a time
@pytest.mark.parametrize(
    "method", [{"name": "rolora"}, FLORA, {"name": "fedexlora"}], ids=["rolora", "flora", "fedexlora"]
)
def test_a_second_round_as_one_cohort_equals_one_at_a_time(tiny_config, method):
    """Round 2, where the first leaves clients in different states: RoLoRA's ``A`` round;
    FLoRA's clients (ranks 1, 4, 2) merging round 1's stacks, one from the state it kept
    and two that never trained; FedEx-LoRA's clients on frozen weights a residual moved."""

    from tests.helpers.cohort import assert_cohort_equals_alone

    setup = build(tiny_config(method=method, **{"train.local_steps": 3}))
    cids = [0, 1, 2]
    results = setup.method.fit_cohort(setup.model, round_jobs(setup, cids))
    for cid, r in zip(cids, results, strict=True):
        r.cid = cid
    server = setup.method.aggregate(setup.method.init_server(setup.model), results, 1)
    jobs = _jobs_from(setup, server, cids)
    jobs[0] = replace(jobs[0], personal=results[0].personal)
    if method["name"] == "rolora":  # the A round: A trains, B is frozen
        names = sent_names(setup.method.shared_names, 2)
        assert any(".lora_A." in n for n in names) and not any(".lora_B." in n for n in names)
    assert_cohort_equals_alone(setup, cids, method["name"], jobs=jobs)


@pytest.mark.slow  # three methods' cohorts
@pytest.mark.parametrize(
    "method",
    [FLEX, FLORA, {**FLEX, "name": "hetlora", "r_min": 1}, {**FLEX, "lora": {"r": 4, "use_dora": True}}],
    ids=["flexlora", "flora", "hetlora", "flexlora+dora"],
)
def test_clients_of_mixed_ranks_train_exactly_their_ranks_inside_a_cohort(tiny_config, method):
    """Ranks 1, 4 and 2 inside r_max = 4, vmapped as one cohort (under DoRA, one at a
    time): each client's factors are masked to its rank (the padded rows of ``A`` and
    columns of ``B`` stay zero while it trains, DoRA's norm being a constant of the
    backward pass), and everything within its rank trains."""
    setup = build(tiny_config(method=method, **{"train.local_steps": 3}))
    trained, finish = [], setup.method.cohort_finish

    def spy(job, params, *args):  # the trained tensors, padded to r_max, before the cut
        trained.append((job.client.cid, params))
        return finish(job, params, *args)

    setup.method.cohort_finish = spy
    setup.method.fit_cohort(setup.model, round_jobs(setup, [0, 1, 2]))
    assert sorted(c for c, _ in trained) == [0, 1, 2]
    for cid, params in trained:
        rank = {0: 1, 1: 4, 2: 2}[cid]
        factors = [(n, t) for n, t in params.items() if ".lora_A." in n or ".lora_B." in n]
        assert factors
        for name, t in factors:
            inside, outside = (t[:rank], t[rank:]) if ".lora_A." in name else (t[:, :rank], t[:, rank:])
            assert not outside.any() and inside.abs().sum() > 0, (cid, name)


@pytest.mark.slow  # a run of five rounds, one of them drawing no client
def test_rolora_alternates_by_the_round_number_in_a_run(tiny_config):
    """In a run (Poisson sampling, seed 4: round 1 draws no client), every client of an odd
    round trains and sends ``B`` with ``A`` frozen, of an even round ``A`` with ``B`` frozen;
    a round that trains no one does not shift the alternation."""
    cfg = tiny_config(
        method={"name": "rolora"},
        seed=4,
        **{"train.rounds": 5, "train.client_sampling": "poisson"},
    )
    setup = build(cfg)
    seen, finish = [], setup.method.cohort_finish

    def spy(job, params, *args):
        result = finish(job, params, *args)
        seen.append((job.rnd, job.received, params, result.uplink))
        return result

    setup.method.cohort_finish = spy
    run(cfg, setup=setup)
    records = read_records(cfg.output_dir)
    assert not records[0]["clients"] and {rnd for rnd, *_ in seen} >= {2, 3}
    for rnd, received, params, uplink in seen:
        sent, frozen = (".lora_B.", ".lora_A.") if rnd % 2 == 1 else (".lora_A.", ".lora_B.")
        assert any(sent in n for n in uplink) and not any(frozen in n for n in uplink), rnd
        for name, t in params.items():
            if frozen in name:
                assert torch.equal(t, received[name]), (rnd, name)


@pytest.mark.slow  # an in-process and a deployed run
def test_dora_on_the_flower_path_gives_the_in_process_run(tiny_config, tmp_path):
    """FlexLoRA with DoRA at ranks 1, 4 and 2 through Flower's ClientApp and ServerApp: the
    magnitudes travel with the factors, and the records are the in-process run's."""
    from fedpeft.flower import codec
    from tests.helpers.flower import in_process_and_deployed

    over = {"method": {**FLEX, "lora": {"r": 4, "use_dora": True}}, "train.rounds": 2}
    a, b, grid, _ = in_process_and_deployed(tiny_config, tmp_path, **over)
    for ra, rb in zip(a, b, strict=True):
        assert rb["clients"] == ra["clients"] and "dropped" not in rb
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-6)
        assert rb["global"] == pytest.approx(ra["global"], rel=1e-6)
        assert rb["payload_bytes_up"] == ra["bytes_up"]
    replies = [codec.from_record(m.content["uplink"]) for m in grid.replies if "uplink" in m.content]
    assert replies and all(any("lora_magnitude_vector" in n for n in u) for u in replies)
