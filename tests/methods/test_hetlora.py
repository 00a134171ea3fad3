"""HETLoRA: truncation and zero-padding, sparsity-weighted aggregation, self-pruning."""

import pytest
import torch

from fedpeft.engines.local import RoundContext
from fedpeft.experiment import build
from fedpeft.methods.base import Job, ServerState, tensor_bytes
from fedpeft.methods.hetlora import pad, rank_of, sparsity_weighted_mean, truncate, update_norm

A, B = "m.lora_A.default.weight", "m.lora_B.default.weight"


def test_truncate_pad_round_trip_is_exact():
    torch.manual_seed(0)
    full = {A: torch.randn(8, 5), B: torch.randn(6, 8), "head.weight": torch.randn(3, 4)}
    small = truncate(full, 3)
    assert small[A].shape == (3, 5) and small[B].shape == (6, 3) and rank_of(small) == 3
    assert torch.equal(small["head.weight"], full["head.weight"])
    back = pad(small, 8)
    assert torch.equal(back[A][:3], full[A][:3]) and torch.equal(back[A][3:], torch.zeros(5, 5))
    assert torch.equal(back[B][:, :3], full[B][:, :3]) and torch.equal(back[B][:, 3:], torch.zeros(6, 5))
    for name in (A, B):  # truncating the padded state gives exactly what was sent
        assert torch.equal(truncate(back, 3)[name], small[name])
    assert tensor_bytes(small) < tensor_bytes(full)


def test_sparsity_weighted_aggregation_by_hand():
    # client 1: update B A with norm 3; client 2: norm 1 -> weights 3/4 and 1/4
    s1 = {A: torch.tensor([[3.0, 0.0]]), B: torch.tensor([[1.0]])}
    s2 = {A: torch.tensor([[0.0, 1.0]]), B: torch.tensor([[1.0]])}
    assert update_norm(s1) == pytest.approx(3.0) and update_norm(s2) == pytest.approx(1.0)
    out = sparsity_weighted_mean([s1, s2], [update_norm(s1), update_norm(s2)])
    torch.testing.assert_close(out[A], torch.tensor([[2.25, 0.25]]))
    torch.testing.assert_close(out[B], torch.tensor([[1.0]]))


def test_client_trains_exactly_its_rank_and_prunes(tiny_config):
    cfg = tiny_config(
        **{
            "method": {
                "name": "hetlora",
                "lora": {"r": 4},
                "r_min": 1,
                "gamma": 0.5,
                "penalty": 0.0,
                "prune_rule": "share",
                "prune_ratio": 0.99,
            }
        }
    )
    setup = build(cfg)
    method, model = setup.method, setup.model
    server = method.init_server(model)
    with torch.no_grad():  # a global state with every rank component non-zero
        server = ServerState({n: t + 0.1 if ".lora_" in n else t for n, t in server.tensors.items()})
    received = truncate(server.tensors, 2)
    client = setup.clients[0]
    trained, finish = [], method.cohort_finish

    def spy(job, params, *args):  # the trained tensors, padded to r_max, before pruning
        trained.append(params)
        return finish(job, params, *args)

    method.cohort_finish = spy
    (result,) = method.fit_cohort(model, [Job(received, {}, client, 0, context=RoundContext(method.train))])
    # components 2..3 were zero-padded and stayed zero while training: rank 2 exactly
    lora_a = [t for name, t in trained[0].items() if ".lora_A." in name]
    assert lora_a and all(torch.count_nonzero(a[2:]) == 0 and torch.count_nonzero(a[:2]) > 0 for a in lora_a)
    # prune_ratio 0.99: the tail (component 1 of 2) holds less than 99 % -> pruned to floor(0.5*2)=1
    assert rank_of(result.uplink) == 1
    result.cid = 0
    new = method.aggregate(server, [result], rnd=1)
    assert int(new.extras["rank.0"]) == 1 and rank_of(method.downlink(new, 0)) == 1
    assert all(t.shape[0] == 4 for n, t in new.tensors.items() if ".lora_A." in n)  # server keeps r_max


def test_ranks_are_drawn_in_range(tiny_config):
    cfg = tiny_config(**{"method": {"name": "hetlora", "lora": {"r": 8}, "r_min": 2}})
    method = build(cfg).method
    ranks = [method.initial_rank(c) for c in range(50)]
    assert min(ranks) >= 2 and max(ranks) <= 8 and len(set(ranks)) > 3
    with pytest.raises(Exception, match="r_min"):
        tiny_config(**{"method": {"name": "hetlora", "lora": {"r": 4}, "r_min": 5}})


def test_rank_draw_mixes_in_the_experiment_seed(tiny_config):
    from fedpeft.methods import build_method

    def method(seed: int):  # as experiment.attach_method builds it: with the experiment's seed
        cfg = tiny_config(seed=seed, method={"name": "hetlora"})
        return build_method(cfg.method, cfg.train, cfg.seed)

    draws = [[method(seed).initial_rank(c) for c in range(20)] for seed in (0, 1, 3)]
    assert draws[0] != draws[1] and draws[0] != draws[2] and draws[1] != draws[2]


def test_pruning_rules_by_hand():
    from fedpeft.methods.hetlora import component_energies, pruned_rank

    # one module, rank 4, components of energy 1, 1, 1, 0.2 (||b_j|| ||a_j||)
    a = torch.diag(torch.tensor([1.0, 1.0, 1.0, 0.2]))
    b = torch.eye(4)
    mods = [(a, b)]
    assert component_energies(mods, 4) == pytest.approx([1, 1, 1, 0.2])
    # gamma 0.75: q = 3, tail = {3}. mean rule: 0.2 < 0.3 * 1 -> prune; < 0.1 * 1 -> keep
    assert pruned_rank(mods, 4, 0.75, 1, 0.3, "mean") == 3
    assert pruned_rank(mods, 4, 0.75, 1, 0.1, "mean") == 4
    # share rule: 0.2 / 3.2 = 0.0625 of the total -> pruned at ratio 0.1
    assert pruned_rank(mods, 4, 0.75, 1, 0.1, "share") == 3
    # equal energies: the share rule's tail is 1/4 of the total, the mean rule's ratio 1
    eq = [(torch.eye(4), torch.eye(4))]
    assert pruned_rank(eq, 4, 0.75, 1, 0.3, "share") == 3  # fires with no sign of a small tail
    assert pruned_rank(eq, 4, 0.75, 1, 0.3, "mean") == 4
    assert pruned_rank(mods, 4, 0.75, 4, 0.3, "mean") == 4  # never below r_min


def test_client_is_scored_with_its_own_adapter(tiny_config):
    """The personalised score is each client's last trained adapter (kept, never sent);
    the truncated global one is reported beside it as local_global."""
    from fedpeft.engines.checkpoint import load_checkpoint
    from fedpeft.experiment import fingerprint, run
    from fedpeft.methods.hetlora import OWN, pad
    from fedpeft.report.results import read_records

    cfg = tiny_config(**{"method": {"name": "hetlora", "lora": {"r": 4}, "r_min": 1}})
    setup = build(cfg)
    method, model = setup.method, setup.model
    sent = []
    real_fit_cohort = method.fit_cohort

    def fit_cohort(*args, **kwargs):
        results = real_fit_cohort(*args, **kwargs)
        sent.extend(results)
        return results

    method.fit_cohort = fit_cohort
    summary = run(cfg, setup=setup)
    ckpt = load_checkpoint(cfg.output_dir / "checkpoint.pt", fingerprint(cfg))
    last = {}
    for result in sent:
        last[result.cid] = result
    for cid, result in last.items():
        own = {n.removeprefix(OWN): t for n, t in ckpt.personal[cid].items() if n.startswith(OWN)}
        for n, t in pad(result.uplink, 4).items():  # the adapter it trained and sent last
            assert torch.equal(own[n], t), n
        assert not any(n.startswith(OWN) for n in result.uplink)
        received = method.downlink(ckpt.server, cid)
        scored = method.eval_state(model, received, ckpt.personal[cid], setup.clients[cid])
        assert any(not torch.equal(scored[n], t) for n, t in pad(received, 4).items())  # not the global
    record = read_records(cfg.output_dir)[-1]
    assert "local_global" in record and record["local"] == summary["final_local"]
    # personal_model: global swaps the two
    method_cfg = {"name": "hetlora", "lora": {"r": 4}, "r_min": 1, "personal_model": "global"}
    cfg2 = tiny_config(**{"method": method_cfg, "output_dir": str(cfg.output_dir) + "-g"})
    run(cfg2)
    swapped = read_records(cfg2.output_dir)[-1]
    assert swapped["local"] == record["local_global"] and swapped["local_own"] == record["local"]


def test_client_that_never_trained_is_scored_with_the_truncated_global_adapter(tiny_config):
    """Before its first round a client has no adapter of its own: it holds what it receives
    (as a FedLR client holds the global model), not the initial adapter and an untrained head."""
    from fedpeft.methods.hetlora import OWN

    setup = build(tiny_config(**{"method": {"name": "hetlora", "lora": {"r": 4}, "r_min": 1}}))
    method, model, client = setup.method, setup.model, setup.clients[0]
    server = method.init_server(model)
    server.tensors = {n: t + 0.5 for n, t in server.tensors.items()}  # a trained-looking global state
    personal = method.init_client(model, setup.initial, client)
    received = method.downlink(server, client.cid)

    scored = method.eval_state(model, received, personal, client)

    assert not any(n.startswith(OWN) for n in personal)
    expected = pad(received, 4)
    assert set(scored) == set(expected)
    for n, t in expected.items():
        assert torch.equal(scored[n], t), n


def test_smaller_rank_update_passes_the_server_shape_check(tiny_config):
    """Over Flower every update is checked against the shared state's shapes: HETLoRA's
    rank-r_i update is zero-padded to r_max for the check (it was refused before)."""
    from fedpeft.flower.codec import ReplyError, check_tensors

    setup = build(tiny_config(**{"method": {"name": "hetlora", "lora": {"r": 4}, "r_min": 1}}))
    method = setup.method
    like = method.init_server(setup.model).tensors
    update = truncate(like, 2)
    assert rank_of(update) == 2
    check_tensors(method.uplink_as_shared(update), like, "update")
    with pytest.raises(ReplyError, match="lora_A"):
        check_tensors(update, like, "update")
    # an A of rank 2 with a B of rank 3 is not padded into shape: still refused
    a_name = next(n for n in update if ".lora_A." in n)
    b_name = a_name.replace(".lora_A.", ".lora_B.")
    mixed = {**update, b_name: truncate(like, 3)[b_name]}
    with pytest.raises(ReplyError):
        check_tensors(method.uplink_as_shared(mixed), like, "update")
