"""Memory that fits (issue 38, item 5): the LM head only where a label is scored,
evaluation batches sized by tokens, and the memory check before the first round."""

from __future__ import annotations

import pytest
import torch
from torch.func import grad_and_value, vmap

from fedpeft.data.task import Draw, Encoded, eval_batches, make_batch
from fedpeft.engines import memory
from fedpeft.engines.local import model_loss, predict_cohort, prepare_step
from fedpeft.engines.local.batches import CohortBatches
from fedpeft.engines.local.gradients import first_order_grad
from fedpeft.engines.memory import InsufficientMemory, check_memory
from fedpeft.experiment import build, make_engine
from fedpeft.methods.base import read_tensors
from fedpeft.models.causal import SCORED, response_nll, scored_positions, with_scored
from tests.helpers.configs import lm_config


@pytest.fixture(scope="module")
def lm_setup(tiny_config_module):
    """A tiny decoder with FedLR's LoRA (its B nonzero, so every gradient is), built once."""
    setup = build(tiny_config_module(method={"name": "fedlr"}))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in setup.model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.3)
    return setup


@pytest.fixture(scope="module")
def tiny_config_module(tiny_backbone, tiny_decoder, tmp_path_factory):
    """``lm_config`` for module-scoped fixtures (``tiny_config`` is per test)."""
    import copy

    from fedpeft.config import parse_config, set_dotted
    from tests.helpers.configs import TINY

    out = tmp_path_factory.mktemp("memory-fit")

    def make(**overrides):
        data = copy.deepcopy(TINY)
        data["model"] = {"backbone": str(tiny_backbone)}
        data["output_dir"] = str(out / "run")
        for key, value in overrides.items():
            set_dotted(data, key, value)
        return parse_config(data, "tiny")

    return lambda **over: lm_config(make, tiny_decoder, **over)


def _trainable(model) -> dict[str, torch.Tensor]:
    return read_tensors(model, [n for n, p in model.named_parameters() if p.requires_grad])


def test_scored_positions_name_each_labelled_tokens_predictor():
    labels = torch.tensor([[-100, -100, 7, 8], [-100, 5, -100, -100]])
    assert scored_positions(labels).tolist() == [1, 2, 4]  # row 0: t = 1, 2; row 1: t = 0
    cohort = torch.stack([labels, torch.full_like(labels, -100)])  # (C, B, L): padded to K = 3
    assert scored_positions(cohort).tolist() == [[1, 2, 4], [-1, -1, -1]]


def test_gathered_head_gives_the_full_logits_loss_and_gradients(lm_setup):
    """Eager: the loss from the logits at the scored positions only equals the loss from
    every position's logits, and so do its gradients, with a cohort's row weights too."""
    model, client = lm_setup.model, lm_setup.clients[0]
    params = _trainable(model)
    batch = make_batch(client.train, torch.arange(6))
    batch["weight"] = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 1.0])  # padded rows count for nothing
    loss = model_loss(model)
    full_grads, full = grad_and_value(loss)(params, batch)
    gathered_grads, gathered = grad_and_value(loss)(params, with_scored(batch))
    assert gathered.item() == pytest.approx(full.item(), rel=1e-6)
    for name in params:
        torch.testing.assert_close(gathered_grads[name], full_grads[name], rtol=1e-5, atol=1e-7)
    logits = model(batch["input_ids"], batch["attention_mask"], scored=with_scored(batch)[SCORED])
    assert logits.shape == (int((batch["labels"][:, 1:] != -100).sum()), model.backbone.config.vocab_size)


def test_scoring_applies_the_head_in_chunks_to_the_same_losses(lm_setup, monkeypatch):
    from fedpeft.models import causal

    model, client = lm_setup.model, lm_setup.clients[0]
    batch = with_scored(make_batch(client.train, torch.arange(6)))
    with torch.no_grad():
        full, counted = model.token_losses(
            model(batch["input_ids"], batch["attention_mask"]), batch["labels"]
        )
    monkeypatch.setattr(causal, "HEAD_CHUNK", 3)  # several chunks
    losses, weight = model.scored_nll(batch)
    torch.testing.assert_close(losses[weight > 0], full[counted], rtol=1e-5, atol=1e-6)


def test_gathered_head_under_vmap_equals_full_logits_and_plain_autograd(lm_setup):
    """The cohort path: two clients' batches stacked (padded rows and tokens), scored
    positions padded to one count; vmapped, the first-order gradient of the gathered loss
    equals that of the full-logits loss and each client's own autograd gradient."""
    model = lm_setup.model
    params = _trainable(model)
    draws = [Draw(c.train, torch.arange(n)) for c, n in zip(lm_setup.clients[:2], (5, 3), strict=True)]
    batches = [d.batch() for d in draws]
    cohort = CohortBatches([[(d,)] for d in draws], torch.device("cpu"))
    stacked = cohort.step(0)
    (gathered,) = prepare_step(model, stacked, cohort.scored[0])  # K worked out on the CPU
    (counted,) = prepare_step(model, stacked)  # K counted from the batch's labels
    assert torch.equal(gathered[SCORED], counted[SCORED])
    both = {n: torch.stack([t, t * 0.5]) for n, t in params.items()}  # two clients' tensors
    loss = model_loss(model)

    def step(p, batch):
        return first_order_grad(lambda q: (loss(q, batch),) * 2, p)

    full_grads, full_loss = vmap(step)(both, stacked[0])
    grads, losses = vmap(step)(both, gathered)
    torch.testing.assert_close(losses, full_loss, rtol=1e-6, atol=0)
    for name in params:
        torch.testing.assert_close(grads[name], full_grads[name], rtol=1e-5, atol=1e-7)
    for c, batch in enumerate(batches):  # each client alone, torch.autograd on every position's logits
        live = {n: t[c].clone().requires_grad_() for n, t in both.items()}
        value = loss(live, batch)
        reference = torch.autograd.grad(value, list(live.values()))
        assert losses[c].item() == pytest.approx(value.item(), rel=1e-5)
        for name, g in zip(live, reference, strict=True):
            torch.testing.assert_close(grads[name][c], g, rtol=1e-4, atol=1e-6)


def test_eval_batches_respect_the_token_budget():
    lengths = torch.tensor([10, 3, 30, 4, 4, 50, 2, 2, 2])
    batches = list(eval_batches(lengths, batch_size=4, batch_tokens=40))
    assert torch.cat(batches).tolist() == list(range(9))  # every row once, in order
    for rows in batches:
        assert len(rows) == 1 or len(rows) * int(lengths[rows].max()) <= 40
    assert [len(b) for b in batches] == [2, 1, 2, 1, 3]  # 50 tokens alone: over the budget
    # rows of at most budget / batch_size tokens: the row-sized batches, exactly
    short = torch.randint(1, 129, (300,))
    by_rows = [r.tolist() for r in eval_batches(short, 128)]
    assert [r.tolist() for r in eval_batches(short, 128, 16384)] == by_rows
    assert by_rows == [list(range(s, min(s + 128, 300))) for s in range(0, 300, 128)]


def test_token_sized_batches_score_the_same(lm_setup, tiny_backbone):
    """A row-heavy causal-LM test set scored in batches of at most 64 tokens (a few rows
    each) gets the NLL of batches of 64 rows; a classifier's cohort predictions likewise."""
    model, setup = lm_setup.model, lm_setup
    data = Encoded.concat([c.test for c in setup.clients] + [setup.global_test])
    assert len(data) >= 20 and int(data.lengths.max()) > 16
    by_rows, rows_count = response_nll(model, data, 64)
    by_tokens, tokens_count = response_nll(model, data, 64, batch_tokens=64)
    assert tokens_count == rows_count and by_tokens == pytest.approx(by_rows, rel=1e-6)
    assert max(len(b) for b in eval_batches(data.lengths, 64, 64)) <= 64 // int(data.lengths.min())


def test_token_sized_cohort_predictions_are_unchanged(tiny_config):
    setup = build(tiny_config())
    states = [_trainable(setup.model)] * 2
    data = [c.test for c in setup.clients[:2]]
    by_rows = predict_cohort(setup.model, states, data, 64)
    by_tokens = predict_cohort(setup.model, states, data, 64, batch_tokens=40)
    for a, b in zip(by_rows, by_tokens, strict=True):
        assert (a == b).all()


def _engine(cfg):
    setup = build(cfg)
    return make_engine(setup, None), setup.method.init_server(setup.model)


@pytest.fixture(scope="module")
def lm_engine(tiny_config_module):
    return _engine(tiny_config_module(**{"eval.generation.samples": 2, "eval.generation.max_new_tokens": 2}))


def test_memory_check_passes_a_tiny_run_and_leaves_it_as_it_was(lm_engine):
    engine, server = lm_engine
    before, rng = _trainable(engine.model), torch.get_rng_state()
    figures = check_memory(engine, server)
    if "skipped" in figures:  # no /proc here
        pytest.skip(figures["skipped"])
    assert 0 < figures["need_mb"] < figures["has_mb"]
    assert figures["step_mb"] >= 0 and figures["score_mb"] >= 0
    assert torch.equal(torch.get_rng_state(), rng)
    for name, value in _trainable(engine.model).items():
        assert torch.equal(value, before[name])


def test_memory_check_refuses_a_run_that_does_not_fit(tiny_config, monkeypatch):
    if memory.rss() is None:
        pytest.skip("no /proc here")
    engine, server = _engine(tiny_config(**{"train.cohort_size": 2}))
    monkeypatch.setenv(memory.LIMIT_ENV, "1")  # a machine of 1 MiB
    with pytest.raises(InsufficientMemory) as err:
        check_memory(engine, server)
    message = str(err.value)
    keys = ("train.batch_size", "train.cohort_size (now 2)", "eval.batch_tokens", "data.max_length")
    for words in ("needs about", "has 0.0 GiB", "FEDPEFT_MEMORY_LIMIT_MB=1", *keys):
        assert words in message


def test_memory_check_skips_quietly_without_proc(lm_engine, monkeypatch):
    monkeypatch.setattr(memory, "PROC_STATUS", memory.Path("/nonexistent/status"))
    assert "skipped" in check_memory(*lm_engine)


def test_the_memory_check_trains_a_copy_of_the_method(tiny_config):
    """The probe's steps leave the run's method as it was: a method that counts its
    fits in itself (as round bookkeeping would) and a wrapper set on the instance (as a
    spy or a logger would be, closing over the run's method) see none of them."""
    if memory.rss() is None:
        pytest.skip("no /proc here")
    engine, server = _engine(tiny_config())
    method = engine.method

    class Counting(type(method)):
        def fit_cohort(self, model, jobs):
            self.fits = getattr(self, "fits", 0) + 1
            return super().fit_cohort(model, jobs)

    method.__class__ = Counting
    wrapped = []
    method.fit_cohort = lambda model, jobs: wrapped.append(1) or Counting.fit_cohort(method, model, jobs)
    figures = check_memory(engine, server)
    assert figures["step_mb"] >= 0  # the probe stepped (a copy of) the method
    assert getattr(method, "fits", 0) == 0 and wrapped == []
    assert engine.method is method and method.fit_cohort.__name__ == "<lambda>"


def test_a_run_that_does_not_fit_is_refused_before_its_first_round(tiny_config, tmp_path, monkeypatch):
    """Through the CLI: one line naming what the run needs, what the machine has and the
    keys to lower, exit code 2, no round run; ``train.memory_check: false`` skips the probe."""
    import json

    from typer.testing import CliRunner

    from fedpeft.cli import app
    from fedpeft.config import dump_config

    if memory.rss() is None:
        pytest.skip("no /proc here")
    monkeypatch.setenv(memory.LIMIT_ENV, "1")  # a machine of 1 MiB
    cfg = tiny_config(output_dir=str(tmp_path / "refused"))
    path = tmp_path / "exp.yaml"
    path.write_text(dump_config(cfg))
    res = CliRunner().invoke(app, ["run", str(path)])
    said = " ".join(res.output.split())
    assert res.exit_code == 2, res.output
    assert "error: this run needs about" in said and "FEDPEFT_MEMORY_LIMIT_MB=1" in said
    assert "train.batch_size (now 8)" in said and "eval.batch_tokens" in said
    assert "Traceback" not in res.output
    assert (
        not (cfg.output_dir / "metrics.jsonl").exists() or not (cfg.output_dir / "metrics.jsonl").read_text()
    )
    assert not (cfg.output_dir / "checkpoint.pt").exists()

    unchecked = tiny_config(output_dir=str(tmp_path / "unchecked"), **{"train.memory_check": False})
    path.write_text(dump_config(unchecked))
    res = CliRunner().invoke(app, ["run", str(path)])
    assert res.exit_code == 0, res.output
    first = json.loads((unchecked.output_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert not any(k.startswith("memory_") for k in first["setup"])


WORDS = [
    "river",
    "stone",
    "green",
    "field",
    "light",
    "north",
    "quiet",
    "house",
    "paper",
    "window",
    "garden",
    "winter",
    "market",
    "silver",
    "table",
    "morning",
    "valley",
    "letter",
    "summer",
    "bridge",
    "candle",
    "forest",
    "orange",
    "harbor",
]


def _long_prompts(path, rows: int, seed: int) -> None:
    """Alpaca-style rows of made-up text: prompts of about 120 words, responses of 12."""
    import json
    import random

    rng = random.Random(seed)
    with open(path, "w") as fh:
        for _ in range(rows):
            prompt = " ".join(rng.choices(WORDS, k=120))
            fh.write(json.dumps({"instruction": prompt, "output": " ".join(rng.choices(WORDS, k=12))}) + "\n")


def test_the_issue_run_completes_with_the_default_eval_settings_within_a_tight_limit(
    tiny_config, tiny_decoder, tmp_path, monkeypatch
):
    """The run of issue 38, made small: a decoder with a full-size vocabulary (MiniLM's,
    30,522), prompts of about 120 tokens, ``data.max_length: 192``, batch 8 and a
    row-heavy test set (400 rows), scored with the default ``eval.batch_size`` (128 rows)
    and ``eval.batch_tokens``. Every position's logits of one 128-row batch alone would
    take 3 GiB; under a limit of 1.5 GiB above what the process holds, the memory check
    passes, the run completes, and its resident memory never grows past the limit."""
    from fedpeft.data.task import eval_batches as real_eval_batches
    from fedpeft.experiment import run
    from fedpeft.report.results import read_records

    if memory.rss() is None:
        pytest.skip("no /proc here")
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    _long_prompts(train, 96, seed=1)
    _long_prompts(test, 400, seed=2)
    cfg = tiny_config(
        **{
            "model.backbone": str(tiny_decoder),
            "data.task": "causal_lm",
            "data.source": "file",
            "data.path": str(train),
            "data.test_path": str(test),
            "data.max_length": 192,
            "data.max_samples": None,
            "data.max_test_samples": None,
            "partition.scheme": "iid",
            "partition.num_clients": 4,
            "train.rounds": 1,
            "eval.local": False,
            "eval.batch_size": 128,  # the defaults (tiny_config's is 64)
            "eval.generation.samples": 2,
            "eval.generation.max_new_tokens": 4,
        }
    )
    defaults = type(cfg.eval)()
    assert (cfg.eval.batch_size, cfg.eval.batch_tokens) == (defaults.batch_size, defaults.batch_tokens)
    batches = []

    def spy(lengths, *args, **kwargs):
        out = list(real_eval_batches(lengths, *args, **kwargs))
        batches.extend(int(lengths[b].max()) * len(b) for b in out)
        return out

    for module in ("metrics.scorers", "metrics.classification", "engines.local.predict", "models.causal"):
        monkeypatch.setattr(f"fedpeft.{module}.eval_batches", spy)
    memory.release_free_heap()
    held = memory.rss()
    limit_mb = held / memory.MIB + 1536
    monkeypatch.setenv(memory.LIMIT_ENV, str(limit_mb))
    assert memory.reset_peak_rss()
    run(cfg)
    grown = memory.peak_rss() - held

    records = read_records(cfg.output_dir)
    assert [r["round"] for r in records] == [1]
    assert torch.isfinite(torch.tensor(records[0]["global"]["nll"]))
    figures = records[0]["setup"]
    assert figures["memory_need_mb"] <= memory.HEADROOM * figures["memory_has_mb"]
    assert batches and max(batches) <= defaults.batch_tokens  # token-sized, not 128 rows x 192
    assert grown < 1536 * memory.MIB, f"grew by {grown / memory.MIB:.0f} MiB"


@pytest.mark.slow
def test_gathered_head_on_smollm2_gives_the_full_logits_loss_and_gradients():
    """The bundled SmolLM2 under FedLR: one cohort step's loss and gradients from the LM
    head at the response positions equal those from every position's logits."""
    from fedpeft.config import load_config
    from fedpeft.experiment import attach_method
    from fedpeft.models.backbone import build_model

    cfg = load_config(
        None, {"model.backbone": "bundled-smollm2", "data.task": "causal_lm", "method.name": "fedlr"}
    )
    model, _ = build_model(cfg.model, 0, cfg.seed, "causal_lm")
    attach_method(cfg, model)
    params = {n: t.normal_(0, 0.02) for n, t in _trainable(model).items()}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.backbone.config.vocab_size, (2, 4, 48), generator=g)  # 2 clients x 4 rows
    labels = ids.clone()
    labels[..., :40] = -100
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": labels,
        "weight": torch.ones(2, 4),
    }
    both = {n: torch.stack([t, -t]) for n, t in params.items()}
    loss = model_loss(model)

    def step(p, b):
        return first_order_grad(lambda q: (loss(q, b),) * 2, p)

    full_grads, full = vmap(step)(both, batch)
    (gathered,) = prepare_step(model, (batch,))
    grads, losses = vmap(step)(both, gathered)
    torch.testing.assert_close(losses, full, rtol=1e-5, atol=0)
    for name in params:
        torch.testing.assert_close(grads[name], full_grads[name], rtol=1e-3, atol=1e-6)


def test_the_memory_check_measures_fedsbs_setup_round_and_a_round_that_trains(tiny_config, monkeypatch):
    """Fed-SB's first round sums full-weight gradients one client at a time and trains
    nothing; the rounds after it train ``R`` as a vmapped cohort. The check measures both
    before the setup, and one state once it is done."""
    if memory.rss() is None:
        pytest.skip("no /proc here")
    fedsb = {"name": "fedsb", "lora": {"r": 4, "alpha": 4}, "init_samples": 12}
    engine, server = _engine(tiny_config(method=fedsb, **{"train.cohort_size": 2}))
    probed, build_probe = [], memory._Probe.__init__

    def spy(self, engine, state, measure=None):
        probed.append(engine.method.is_set_up(state))
        build_probe(self, engine, state, measure)

    monkeypatch.setattr(memory._Probe, "__init__", spy)
    assert check_memory(engine, server)["step_mb"] >= 0
    assert probed == [False, True]
    probed.clear()
    check_memory(engine, engine.method.training_server(server))
    assert probed == [True]
