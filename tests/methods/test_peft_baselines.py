"""C2A's parameter-efficient baselines: prompt tuning, Compacter and AdaMix.

Each is FedAvg over its trainable tensors; the conformance suite (tests/methods/test_conformance.py)
and the cohort check (tests/engines/test_cohort.py) cover the federated side. Here: what each
module computes, checked against the model built by hand.
"""

from __future__ import annotations

import pytest
import torch

from fedpeft.data.task import IGNORE, make_batch, take_steps
from fedpeft.engines.local import predict_cohort
from fedpeft.experiment import build
from fedpeft.methods.base import load_tensors
from fedpeft.models.masks import additive_mask
from fedpeft.peft.compacter import PHMLinear, phm_weight
from fedpeft.peft.prompt import PromptedBackbone, PromptSpec
from tests.helpers.cohort import assert_cohort_equals_alone, round_jobs, step_inputs

HIDDEN = 32  # the tiny backbone's (tests/conftest.py): 2 layers, so 4 Houlsby sites
SITES = 4


def perturbed(tensors: dict, scale: float = 0.05, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {n: t + scale * torch.randn(t.shape, generator=g) for n, t in tensors.items()}


def padded_batch(setup, rows: int = 8) -> dict:
    batch = make_batch(setup.clients[0].train, torch.arange(rows))
    assert (batch["attention_mask"] == 0).any(), "want rows of different lengths"
    return batch


def logits_of(model, batch, tensors=None) -> torch.Tensor:
    if tensors is not None:
        load_tensors(model, tensors)
    model.eval()
    with torch.no_grad():
        return model(batch["input_ids"], batch["attention_mask"])


def head_count(model) -> int:
    return sum(p.numel() for p in model.head.parameters())


def trainable_count(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# ---------------------------------------------------------------- prompt tuning


def vocab_ids_of(prompt: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
    """The vocabulary token each (sample-vocab initialised) virtual token is a copy of."""
    ids = [torch.nonzero((embeddings == row).all(1))[0, 0] for row in prompt]
    return torch.stack(ids)


def assert_prompt_is_tokens_in_front(wrapped: PromptedBackbone, batch: dict, causal: bool) -> None:
    """A sample-vocab prompt is the embeddings of real tokens: the prompted backbone's
    output on ``x`` must be the bare backbone's on ``[v; x]``, virtual positions cut."""
    base, prompt = wrapped.base, wrapped.prompt.embedding.weight.detach()
    v = vocab_ids_of(prompt, base.get_input_embeddings().weight.detach())
    rows, count = batch["input_ids"].shape[0], len(v)
    ids = torch.cat([v.expand(rows, -1), batch["input_ids"]], dim=1)
    mask = torch.cat([torch.ones(rows, count, dtype=torch.long), batch["attention_mask"]], dim=1)
    wrapped.eval()
    with torch.no_grad():
        got = wrapped(
            input_ids=batch["input_ids"],
            attention_mask=additive_mask(batch["attention_mask"], causal, torch.float32),
        ).last_hidden_state
        bias = additive_mask(mask, causal, torch.float32)
        want = base(input_ids=ids, attention_mask=bias).last_hidden_state
    assert got.shape == batch["input_ids"].shape + (base.config.hidden_size,)
    torch.testing.assert_close(got, want[:, count:], atol=1e-5, rtol=1e-5)


def test_prompt_is_virtual_tokens_in_front_of_an_encoder_input(tiny_config):
    setup = build(tiny_config(method={"name": "prompt_tuning", "prompt": {"num_virtual_tokens": 5}}))
    model = setup.model
    assert_prompt_is_tokens_in_front(model.backbone, padded_batch(setup), causal=False)
    # only the prompt and the head train: P x H + head
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"backbone.prompt.embedding.weight", "head.weight", "head.bias"}
    assert trainable_count(model) == 5 * HIDDEN + head_count(model)
    # the prompt is what moves the output: another prompt, other logits
    batch = padded_batch(setup)
    before = logits_of(model, batch)
    after = logits_of(model, batch, perturbed({"backbone.prompt.embedding.weight": setup.initial[
        "backbone.prompt.embedding.weight"]}))  # fmt: skip
    assert not torch.allclose(before, after)


def test_prompt_in_front_of_a_decoder_is_seen_by_every_later_token(tiny_decoder):
    from transformers import AutoModel

    torch.manual_seed(0)
    base = AutoModel.from_pretrained(tiny_decoder)
    wrapped = PromptedBackbone(base, PromptSpec(num_virtual_tokens=3), causal=True)
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]]), "attention_mask": torch.tensor(
        [[1, 1, 1, 1], [1, 1, 0, 0]])}  # fmt: skip
    assert_prompt_is_tokens_in_front(wrapped, batch, causal=True)


def test_prompt_uniform_init_and_too_long_inputs(tiny_backbone):
    from transformers import AutoModel

    base = AutoModel.from_pretrained(tiny_backbone)
    wrapped = PromptedBackbone(base, PromptSpec(num_virtual_tokens=120, init="uniform"), causal=False)
    prompt = wrapped.prompt.embedding.weight
    assert prompt.shape == (120, HIDDEN) and prompt.abs().max() <= 0.5 and prompt.std() > 0.2
    ids = torch.ones(1, 9, dtype=torch.long)  # 120 + 9 > the tiny BERT's 128 positions
    with pytest.raises(ValueError, match=r"120 virtual tokens \+ 9 input tokens .*128"):
        wrapped(input_ids=ids, attention_mask=additive_mask(torch.ones_like(ids), False, torch.float32))


@pytest.mark.parametrize("name", ["prompt_tuning", "adamix"])
def test_token_classification_tags_each_real_token(tiny_config, tmp_path, name):
    """One logit row per real token (prompt tuning cuts its virtual positions; AdaMix's
    consistency counts the tagged tokens), and a cohort trains each client as alone."""
    from tests.helpers.configs import SENTENCES, ner_config, write_conll

    cfg = ner_config(tiny_config, write_conll(tmp_path / "t.conll", SENTENCES * 20), method={"name": name},
                     **{"train.local_steps": None, "train.local_epochs": 1})  # fmt: skip
    setup = build(cfg)
    batch = make_batch(setup.clients[0].train, torch.arange(4))
    assert logits_of(setup.model, batch).shape[:2] == batch["labels"].shape
    assert_cohort_equals_alone(setup, list(range(len(setup.clients))), name)


def test_prompt_tuning_refuses_causal_lm_saying_why(tiny_config, tiny_decoder):
    from fedpeft.config import ConfigError
    from tests.helpers.configs import lm_config

    cfg = lm_config(tiny_config, tiny_decoder, method={"name": "prompt_tuning"})
    with pytest.raises(ConfigError, match=r"data\.task causal_lm; .*soft prompt"):
        build(cfg)


# ---------------------------------------------------------------- Compacter


def test_phm_weight_is_the_sum_of_kronecker_products():
    # Prepare
    g = torch.Generator().manual_seed(0)
    n, out_f, in_f, rank = 4, 12, 8, 2
    rule = torch.nn.Parameter(torch.randn(n, n, n, generator=g))
    layer = PHMLinear(in_f, out_f, rule, rank)
    with torch.no_grad():
        layer.left.copy_(torch.randn(n, out_f // n, rank, generator=g))
        layer.bias.copy_(torch.randn(out_f, generator=g))
    x = torch.randn(5, in_f, generator=g)
    # Execute
    w = phm_weight(rule, layer.left, layer.right)
    y = layer(x)
    # Assert: W = sum_i A_i (x) (s_i t_i^T), by torch.kron
    by_hand = sum(torch.kron(rule[i], layer.left[i] @ layer.right[i]) for i in range(n))
    assert w.shape == (out_f, in_f)
    torch.testing.assert_close(w, by_hand)
    torch.testing.assert_close(y, x @ by_hand.T + layer.bias)
    # each fast weight has the configured rank
    assert all(torch.linalg.matrix_rank(layer.left[i] @ layer.right[i]) == rank for i in range(n))
    with pytest.raises(ValueError, match="output size 10 is not a multiple of n = 4"):
        PHMLinear(in_f, 10, rule, rank)


def test_compacter_has_one_rule_shared_by_every_layer(tiny_config):
    setup = build(tiny_config(method={"name": "compacter"}))
    plain = build(tiny_config(method={"name": "fedbf"}))  # the same backbone and head, nothing added
    model, method = setup.model, setup.method
    layers = [m for m in model.modules() if isinstance(m, PHMLinear)]
    assert len(layers) == 2 * SITES  # down and up at every site
    rule = layers[0].rule
    assert rule.shape == (4, 4, 4) and all(m.rule is rule for m in layers)
    names = [n for n, p in model.named_parameters() if p is rule]
    assert len(names) == 1 and names[0] in method.shared_names
    # parameters: per adapter 2 k (d + r) + r + d, plus n^3 once, plus the head
    d, r, n, k = HIDDEN, 16, 4, 1
    assert trainable_count(model) == SITES * (2 * k * (d + r) + r + d) + n**3 + head_count(model)
    # up starts at 0: the model starts as the pretrained one
    batch = padded_batch(setup)
    pretrained = logits_of(plain.model, batch)
    torch.testing.assert_close(logits_of(model, batch), pretrained)
    # the one rule acts in every layer: with the adapters active, a zero rule (passed as the
    # vectorised step passes tensors, by name) zeroes every PHM weight at once
    factors = {n: t for n, t in setup.initial.items() if n.endswith((".left", ".right")) or n == names[0]}
    active = {**setup.initial, **perturbed(factors, scale=0.5)}  # biases and head as they were
    load_tensors(model, active)
    assert not torch.allclose(logits_of(model, batch), pretrained)
    zero_rule = {**active, names[0]: torch.zeros_like(rule)}
    with torch.no_grad():
        out = torch.func.functional_call(model, zero_rule, (batch["input_ids"], batch["attention_mask"]))
    torch.testing.assert_close(out, pretrained)
    # a round trains it and sends it, once
    (result,) = method.fit_cohort(model, round_jobs(setup, [0]))
    assert sum(1 for v in result.uplink.values() if v.shape == (4, 4, 4)) == 1
    assert not torch.equal(result.uplink[names[0]], setup.initial[names[0]])


# ---------------------------------------------------------------- AdaMix


def single_adapter(tensors: dict, route: torch.Tensor | None, sites: list[str]) -> dict:
    """AdaMix's tensors as FedAP's (one adapter per site): expert ``route[s]`` of each
    projection, or with ``route`` None the experts' average."""
    out = {}
    for name, t in tensors.items():
        site = next((s for s in sites if name.startswith(s + ".")), None)
        if site is None:
            out[name] = t
        elif route is None:
            out[name] = t.mean(0)
        else:
            out[name] = t[route[sites.index(site), 0 if ".down." in name else 1]]
    return out


def test_adamix_routing_is_seeded_and_changes_every_step(tiny_config):
    setup = build(tiny_config(method={"name": "adamix"}))
    method, client = setup.method, setup.clients[0]

    def routes(seed: int) -> list[torch.Tensor]:
        return [b["route"] for (b,) in step_inputs(method, client, 12, torch.Generator().manual_seed(seed))]

    a, b, c = routes(1), routes(1), routes(2)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))  # seeded
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))  # another round, other routes
    assert a[0].shape == (2, SITES, 2)  # two passes (consistency), each site's down and up expert
    assert len({tuple(x.flatten().tolist()) for x in a}) == len(a)  # a new draw every step
    assert set(torch.cat(a).flatten().tolist()) == {0, 1, 2, 3}
    assert any(not torch.equal(x[0], x[1]) for x in a)  # the two passes route independently
    # the batches are FedAvg's: the routing has its own stream
    plain = take_steps(client.train, setup.cfg.train.batch_size, 12, torch.Generator().manual_seed(1))
    steps = step_inputs(method, client, 12, torch.Generator().manual_seed(1))
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for (x,), y in zip(steps, plain, strict=True))


def test_a_step_draw_rides_with_its_batch_in_a_cohort():
    """A batch's extra entry (AdaMix's routing) is stacked per client; a finished client's is 0."""
    from fedpeft.data.task import Draw, Encoded
    from fedpeft.engines.local.batches import CohortBatches

    def draw_of(ids: list[int], route: list[int]) -> Draw:
        data = Encoded(torch.tensor([ids]), torch.tensor([len(ids)]), torch.tensor([1]))
        return Draw(data, torch.tensor([0]), {"route": torch.tensor([route])})

    one, two = draw_of([5, 6], [1, 2]), draw_of([7, 8, 9], [3, 0])
    (batch,) = CohortBatches([[(one,)], [], [(two,)]], torch.device("cpu")).step(0)
    assert batch["route"].tolist() == [[[1, 2]], [[0, 0]], [[3, 0]]]
    assert batch["input_ids"].shape == (3, 1, 3)


def test_adamix_infers_with_the_averaged_experts(tiny_config):
    setup = build(tiny_config(method={"name": "adamix"}))
    fedap = build(tiny_config(method={"name": "fedap", "adapter": {"bottleneck": 16}}))
    experts = perturbed(setup.initial)  # four different experts per projection
    batch = padded_batch(setup)
    got = logits_of(setup.model, batch, experts)
    want = logits_of(fedap.model, batch, single_adapter(experts, None, setup.method.sites))
    torch.testing.assert_close(got, want)
    assert not torch.allclose(want, logits_of(fedap.model, batch, single_adapter(
        experts, torch.zeros(SITES, 2, dtype=torch.long), setup.method.sites)))  # fmt: skip
    # the vectorised evaluation holds the same merged model
    merged = single_adapter(experts, None, setup.method.sites)
    (pred,) = predict_cohort(setup.model, [experts], setup.global_test, 16)
    (by_hand,) = predict_cohort(fedap.model, [merged], setup.global_test, 16)
    assert (pred == by_hand).all()


def test_adamix_step_is_routed_passes_with_consistency(tiny_config):
    """The objective by hand: two FedAP models holding the experts each pass routes to;
    the first's cross-entropy plus 0.5 x the symmetric KL between the two; gradients only
    on the routed experts."""
    # Prepare
    setup = build(tiny_config(method={"name": "adamix", "consistency": 0.5}))
    fedap = build(tiny_config(method={"name": "fedap", "adapter": {"bottleneck": 16}}))
    method, model = setup.method, setup.model
    params = perturbed(setup.initial)
    (batch,) = next(iter(step_inputs(method, setup.clients[0], 1, torch.Generator().manual_seed(5))))
    route = batch["route"]
    # Execute
    total, ce = method.objective(model)(params, {}, (batch,))
    reported, grads = method.step_gradients(model)(params, {}, (batch,))
    # Assert
    a = logits_of(fedap.model, batch, single_adapter(params, route[0], method.sites))
    b = logits_of(fedap.model, batch, single_adapter(params, route[1], method.sites))
    log_a, log_b = a.log_softmax(-1), b.log_softmax(-1)
    kl_ab = (log_a.exp() * (log_a - log_b)).sum(-1)
    kl_ba = (log_b.exp() * (log_b - log_a)).sum(-1)
    ce_hand = torch.nn.functional.cross_entropy(a, batch["labels"])
    torch.testing.assert_close(ce.detach(), ce_hand)
    torch.testing.assert_close(total.detach(), ce_hand + 0.5 * ((kl_ab + kl_ba) / 2).mean())
    assert float(reported) == pytest.approx(float(ce_hand), rel=1e-5)
    for s, site in enumerate(method.sites):
        for proj, col in (("down", 0), ("up", 1)):
            g = grads[f"{site}.{proj}.weight"]
            used = set(route[:, s, col].tolist())
            for m in range(4):
                assert (g[m].abs().sum() > 0) == (m in used), (site, proj, m, used)


def test_adamix_consistency_pulls_each_pass_to_the_other_held_still():
    """``(KL(sg p_b || p_a) + KL(sg p_a || p_b)) / 2``: each KL's target is held constant (as
    AdaMix's code), so the gradient for ``a`` is ``(softmax(a) - softmax(b)) / 2`` per row."""
    from fedpeft.methods.adamix import consistency_loss
    from fedpeft.models.backbone import TaskModel

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 3, generator=g, requires_grad=True), torch.randn(4, 3, generator=g)
    batch = {"labels": torch.zeros(4, dtype=torch.long), "weight": torch.tensor([1.0, 1.0, 1.0, 0.0])}
    value = consistency_loss(object.__new__(TaskModel), a, b, batch)
    (grad,) = torch.autograd.grad(value, a)
    la, lb = a.detach().log_softmax(-1), b.log_softmax(-1)
    sym = ((la.exp() * (la - lb)).sum(-1) + (lb.exp() * (lb - la)).sum(-1)) / 2
    torch.testing.assert_close(value.detach(), sym[:3].mean())  # the padded row counts for nothing
    want = (la.exp() - lb.exp()) / 2 / 3 * batch["weight"].unsqueeze(1)
    torch.testing.assert_close(grad, want)


@pytest.mark.parametrize("kind", ["tokens", "lm", "spans"])
def test_adamix_consistency_counts_what_the_task_loss_counts(kind):
    from fedpeft.methods.adamix import consistency_loss
    from fedpeft.models.backbone import SpanExtractor, TokenClassifier
    from fedpeft.models.causal import CausalLM

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 5, 3, generator=g), torch.randn(2, 5, 3, generator=g)
    labels = torch.tensor([[0, 1, IGNORE, 2, IGNORE], [IGNORE, 1, 1, IGNORE, IGNORE]])
    batch = {"labels": labels, "weight": torch.tensor([1.0, 1.0])}

    def sym(x, y):  # (..., C) -> (...)
        lx, ly = x.log_softmax(-1), y.log_softmax(-1)
        return ((lx.exp() * (lx - ly)).sum(-1) + (ly.exp() * (ly - lx)).sum(-1)) / 2

    if kind == "tokens":
        model, want = object.__new__(TokenClassifier), sym(a, b)[labels != IGNORE].mean()
    elif kind == "lm":  # position t predicts token t + 1
        model, want = object.__new__(CausalLM), sym(a[:, :-1], b[:, :-1])[labels[:, 1:] != IGNORE].mean()
    else:  # start and end: distributions over each row's labelled positions
        model, a, b = object.__new__(SpanExtractor), a[..., :2], b[..., :2]
        per_row = [sym(a[r, labels[r] != IGNORE].T, b[r, labels[r] != IGNORE].T).mean() for r in range(2)]
        want = torch.stack(per_row).mean()
    torch.testing.assert_close(consistency_loss(model, a, b, batch), want)
    assert float(consistency_loss(model, a, a, batch)) == pytest.approx(0.0, abs=1e-7)


def test_adamix_trains_and_sends_every_expert(tiny_config):
    d, r, m = HIDDEN, 16, 4
    setup = build(tiny_config(method={"name": "adamix"}))
    model = setup.model
    assert trainable_count(model) == SITES * (m * (r * d + r) + m * (d * r + d)) + head_count(model)
    assert all(t.shape[0] == m for n, t in setup.initial.items() if ".adapter." in n)
    # AdaMix's released recipe: one site per layer after the FFN, four down experts, one up
    recipe = build(tiny_config(method={"name": "adamix", "adapter": {
        "sites": [r"layer\.\d+\.output\.dense$"], "share_up": True}}))  # fmt: skip
    assert trainable_count(recipe.model) == 2 * (m * (r * d + r) + (d * r + d)) + head_count(recipe.model)
    routes = [b["route"] for (b,) in step_inputs(recipe.method, setup.clients[0], 6, torch.Generator())]
    assert all((x[..., 1] == 0).all() for x in routes)
    # a round moves the routed experts apart: every expert is sent, and they now differ
    (result,) = setup.method.fit_cohort(model, round_jobs(setup, [0]))
    up = next(n for n in result.uplink if n.endswith(".up.weight"))
    assert result.uplink[up].shape == (m, d, r)
    assert len({tuple(e.flatten().tolist()) for e in result.uplink[up]}) > 1
