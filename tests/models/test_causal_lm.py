"""Causal-LM instruction tuning: formats, the response-only loss, generation, a whole run."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fedpeft.data.instructions import encode_instructions, instruction_columns
from fedpeft.data.sources import DataError
from fedpeft.data.tables import read_jsonl_messages
from fedpeft.data.task import IGNORE, make_batch
from fedpeft.methods.capabilities import refusal
from fedpeft.models.causal import CausalLM, references_of
from tests.helpers.configs import lm_config


@pytest.fixture(scope="module")
def decoder(tiny_decoder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_decoder)
    return CausalLM(AutoModelForCausalLM.from_pretrained(tiny_decoder)), tok


PROMPTS = [
    [{"role": "user", "content": "define dog"}],
    [{"role": "user", "content": "define a very small cat"}],
]
RESPONSES = ["a domestic animal", "a feline"]


def test_response_only_loss_mask(decoder):
    """Prompt and padding positions hold no label, and the loss's gradient never
    reaches a logit that predicts a prompt token."""
    model, tok = decoder
    data = encode_instructions(PROMPTS, RESPONSES, tok, max_length=64)
    for row in range(2):
        p, n = int(data.prompt_lengths[row]), int(data.lengths[row])
        assert (data.labels[row, :p] == IGNORE).all() and (data.labels[row, n:] == IGNORE).all()
        assert torch.equal(data.labels[row, p:n], data.ids[row, p:n])
    batch = make_batch(data, torch.arange(2))
    logits = torch.randn(*batch["input_ids"].shape, model.backbone.config.vocab_size, requires_grad=True)
    model.loss(logits, batch).backward()
    touched = logits.grad.abs().sum(-1) > 0  # (B, L): positions whose logits the loss used
    for row in range(2):
        p, n = int(data.prompt_lengths[row]), int(data.lengths[row])
        # position t predicts token t + 1: exactly positions p - 1 .. n - 2 count
        expected = torch.zeros(touched.shape[1], dtype=torch.bool)
        expected[p - 1 : n - 1] = True
        assert torch.equal(touched[row], expected)
    # the loss is the mean over response tokens of -log p(token | before)
    logp = torch.log_softmax(logits.detach(), -1)
    nll = [-logp[r, t - 1, batch["input_ids"][r, t]] for r in range(2)
           for t in range(int(data.prompt_lengths[r]), int(data.lengths[r]))]  # fmt: skip
    assert model.loss(logits.detach(), batch) == pytest.approx(float(torch.stack(nll).mean()), rel=1e-5)


def test_long_prompt_gets_no_response_and_responses_are_truncated(decoder, caplog):
    _, tok = decoder
    long = [{"role": "user", "content": " ".join(["word"] * 50)}]
    data = encode_instructions([long, *PROMPTS], ["x", *RESPONSES], tok, max_length=14)
    assert "1 of 3 examples have no room for a response" in caplog.text
    assert (data.labels[0] == IGNORE).all() and (data.labels[1:] != IGNORE).any(-1).all()
    assert int(data.lengths.max()) == 14 and int(data.prompt_lengths[0]) == 14
    with pytest.raises(DataError, match="every prompt is 4 tokens or longer"):
        encode_instructions(PROMPTS, RESPONSES, tok, max_length=4)


@pytest.mark.slow
def test_chat_template_round_trip_smollm2():
    """SmolLM2's own template: the prompt decodes back to the rendered conversation with
    the assistant's turn open, the labelled tokens to the response and its end of turn."""
    from fedpeft.config import ModelConfig
    from fedpeft.models.backbone import load_tokenizer

    tok = load_tokenizer(ModelConfig(backbone="bundled-smollm2"))
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": 'Define "dog".'}]
    data = encode_instructions([prompt], ["A domesticated canid."], tok, max_length=64)
    p, n = int(data.prompt_lengths[0]), int(data.lengths[0])
    assert tok.decode(data.ids[0, :p]) == (
        '<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nDefine "dog".<|im_end|>\n'
        "<|im_start|>assistant\n"
    )
    assert tok.decode(data.ids[0, p:n]) == "A domesticated canid.<|im_end|>"
    assert references_of(data, tok) == ["A domesticated canid."]


def test_instruction_formats(tmp_path):
    alpaca = {"instruction": ["Sum", "Greet"], "input": ["2 and 3", None], "output": ["5", "hello"]}
    prompts, responses = instruction_columns(alpaca, "a.jsonl")
    assert prompts[0] == [{"role": "user", "content": "Sum\n\n2 and 3"}] and responses == ["5", "hello"]
    assert prompts[1] == [{"role": "user", "content": "Greet"}]
    path = tmp_path / "chat.jsonl"
    rows = [
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                      {"role": "assistant", "content": "a"}]},
        {"messages": [{"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"}]},
    ]  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prompts, responses = instruction_columns(read_jsonl_messages(path), str(path))
    assert [len(p) for p in prompts] == [2, 1] and responses == ["a", "a2"]
    bad = {"messages": [[{"role": "user", "content": "u"}, {"role": "user", "content": "again"}]]}
    with pytest.raises(DataError, match=r"chat.jsonl, line 1: the last message"):
        instruction_columns(bad, str(path))
    with pytest.raises(DataError, match="needs columns instruction and output"):
        instruction_columns({"text": ["x"]}, "t.csv")
    with pytest.raises(DataError, match=r"t.csv: row 1 \(0-based\): column 'output'"):
        instruction_columns({"instruction": ["a", "b"], "output": ["x", " "]}, "t.csv")
    (tmp_path / "broken.jsonl").write_text('{"messages": []}\nnot json\n')
    with pytest.raises(DataError, match="broken.jsonl:2: not valid JSON"):
        read_jsonl_messages(tmp_path / "broken.jsonl")


def test_tiny_decoder_trains_and_generates_through_fedpeft_run(tiny_config, tiny_decoder, tmp_path):
    """WordNet definition generation on a random 2-layer decoder, through the CLI: the
    held-out response loss falls, and every generation score is recorded."""
    from typer.testing import CliRunner

    from fedpeft.cli import app
    from fedpeft.config import dump_config
    from fedpeft.report.results import read_records

    cfg = lm_config(tiny_config, tiny_decoder)
    path = tmp_path / "lm.yaml"
    path.write_text(dump_config(cfg))
    res = CliRunner().invoke(app, ["run", str(path)])
    assert res.exit_code == 0, res.output
    records = read_records(cfg.output_dir)
    first, last = records[0]["global"], records[-1]["global"]
    assert set(first) >= {"nll", "perplexity", "bleu", "chrf", "ter", "rouge_l", "meteor", "exact_match"}
    assert last["nll"] < first["nll"]  # it learns the glosses' words
    assert last["perplexity"] == pytest.approx(torch.tensor(last["nll"]).exp().item(), rel=1e-5)
    assert records[-1]["local"]["nll_mean"] > 0  # every client scored on its own test split


#: instruction tuning in cohorts: what each scenario's step adds
LM_COHORTS = {"fedlr": "plain LoRA", "fedap": "Llama adapters", "pf2lora": "the bilevel step",
              "hetlora": "masked ranks", "adamix": "routed experts"}  # fmt: skip


@pytest.mark.parametrize("name", LM_COHORTS)
def test_lm_cohort_equals_one_at_a_time(tiny_config, tiny_decoder, name):
    """Instruction tuning vectorises like classification: clients with different step
    counts and response lengths (token labels padded with IGNORE) trained as one cohort
    get the rounds they get alone (same tolerance as tests/engines/test_cohort.py). Plain LoRA,
    Llama adapters, the bilevel step, masked ranks and routed experts; every method's step is the same
    function of ``model.loss`` (tests/engines/test_cohort.py covers them all on classification)."""
    from fedpeft.experiment import build
    from tests.helpers.cohort import assert_cohort_equals_alone

    # Under SGD: a lone client trains with the decoder's own attention kernel and a cohort
    # with eager attention (local.attention.training_attention), whose float rounding differs; Adam
    # turns that noise into steps of size lr where a gradient is near zero (one weight in
    # ~2,000 of AdaMix or FedAP lands 1.5e-5 apart), while under SGD they agree to 1e-5.
    over = {"train.local_steps": None, "train.local_epochs": 1, "train.optimizer": "sgd"}
    cfg = lm_config(tiny_config, tiny_decoder, method={"name": name}, **over)
    setup = build(cfg)
    cids = list(range(len(setup.clients)))
    assert_cohort_equals_alone(setup, cids, name)


def _registered() -> list[str]:
    from fedpeft.methods import REGISTRY

    return sorted(REGISTRY)


@pytest.mark.parametrize("name", _registered())
def test_every_method_runs_on_instruction_tuning_or_says_why_not(tiny_config, tiny_decoder, tmp_path, name):
    from fedpeft.config import ConfigError
    from fedpeft.experiment import run
    from fedpeft.methods import REGISTRY
    from fedpeft.report.results import read_records

    cfg = lm_config(tiny_config, tiny_decoder, method={"name": name}, output_dir=str(tmp_path / name),
                    **{"train.rounds": 1, "train.local_steps": 2, "eval.generation.samples": 1,
                       "eval.generation.max_new_tokens": 3})  # fmt: skip
    if name == "fedbf":  # BitFit: a Llama has no bias terms to train
        with pytest.raises(ValueError, match="nothing to train on this backbone"):
            run(cfg)
        return
    if refusal(REGISTRY[name], "causal_lm"):  # defined for classification heads only: says why
        with pytest.raises(ConfigError, match=rf"method\.name {name}: .*data\.task causal_lm; .+"):
            run(cfg)
        return
    run(cfg)
    last = read_records(cfg.output_dir)[-1]
    assert math.isfinite(last["loss"]), name
    scores = last.get("global") or {}
    assert "rouge_l" in scores or "rouge_l_mean" in last["local"], name


def test_a_personal_head_is_refused_on_a_causal_lm(tiny_config, tiny_decoder, tmp_path):
    from fedpeft.experiment import run

    with pytest.raises(ValueError, match="no classification head"):
        run(lm_config(tiny_config, tiny_decoder, method={"name": "fedlr", "head": "personal"},
                      output_dir=str(tmp_path / "head")))  # fmt: skip


LM_LOADER = r"""
import sys
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

backbone, adapter, batch_file, out_file = sys.argv[1:]
batch = torch.load(batch_file)
model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(backbone), adapter).eval()
with torch.no_grad():
    torch.save(model(**batch).logits, out_file)
"""


@pytest.mark.slow  # 10-18 s: out of the default tier for its 10 minutes (CI's slow tier runs it)
def test_lm_export_loads_as_documented_and_reproduces_the_model(tiny_config, tiny_decoder, tmp_path):
    """The global adapter of an instruction-tuned run, loaded in a fresh process with
    ``AutoModelForCausalLM`` + ``PeftModel.from_pretrained`` (docs/tasks.md), gives the
    trained model's next-token logits."""
    import subprocess
    import sys

    from fedpeft.engines.checkpoint import load_checkpoint
    from fedpeft.experiment import build, fingerprint, run
    from fedpeft.methods.base import load_tensors

    cfg = lm_config(tiny_config, tiny_decoder, **{"train.rounds": 2, "eval.every": 2})
    setup = build(cfg)
    run(cfg, setup=setup)
    info = json.loads((cfg.output_dir / "adapter" / "fedpeft_model.json").read_text())
    assert info["task"] == "causal_lm" and "id2label" not in info
    server = load_checkpoint(cfg.output_dir / "checkpoint.pt", fingerprint(cfg)).server
    load_tensors(setup.model, {**setup.initial, **setup.method.global_state(server)})
    batch = make_batch(setup.global_test, torch.arange(4))
    batch = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    setup.model.eval()
    with torch.no_grad():
        trained = setup.model(**batch)
    b_names = [n for n in server.tensors if "lora_B" in n]
    assert b_names and all(server.tensors[n].abs().sum() > 0 for n in b_names)  # it did train
    torch.save(batch, tmp_path / "batch.pt")
    cmd = [sys.executable, "-c", LM_LOADER, str(tiny_decoder), str(cfg.output_dir / "adapter"),
           str(tmp_path / "batch.pt"), str(tmp_path / "logits.pt")]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    loaded = torch.load(tmp_path / "logits.pt")
    mask = batch["attention_mask"].bool()  # padded positions differ by mask convention only
    torch.testing.assert_close(loaded[mask], trained[mask], atol=1e-5, rtol=1e-4)


def test_generation_strategies_and_seeded_sampling(decoder):
    """Greedy and beam search are deterministic; sampling is reproducible from its seed
    and varies with it; prompts of different lengths are padded on the left, so a
    prompt's continuation does not depend on its batch."""
    from fedpeft.config import GenerationConfig
    from fedpeft.models.causal import generate

    model, tok = decoder
    data = encode_instructions(PROMPTS, RESPONSES, tok, max_length=64)
    greedy = GenerationConfig(max_new_tokens=5)
    together = generate(model, data, tok, greedy, batch_size=2)
    alone = [generate(model, data.subset([i]), tok, greedy, batch_size=1)[0] for i in range(2)]
    assert together == alone and all(together)
    beam = GenerationConfig(strategy="beam", num_beams=3, max_new_tokens=5)
    assert generate(model, data, tok, beam, 2) == generate(model, data, tok, beam, 2)
    sample = GenerationConfig(strategy="sample", temperature=1.5, top_p=1.0, max_new_tokens=8)
    first = generate(model, data, tok, sample, 2)
    assert generate(model, data, tok, sample, 2) == first
    others = [generate(model, data, tok, sample.model_copy(update={"seed": s}), 2) for s in (1, 2, 3)]
    assert any(o != first for o in others)
