"""Peak memory of one local step and of scoring: fedpeft against a plain HF + PEFT loop.

The same decoder (the bundled SmolLM2-135M, GGUF dequantised to float32), the same LoRA
(r = 8 on q_proj / v_proj, AdamW, float32) and the same batches: ``--rows`` rows of
``--lengths`` tokens, random token ids, the first 90 % of each row a prompt and the rest
a response (the only tokens trained on and scored, as instruction tuning does).

- ``plain``: ``peft.get_peft_model``, the model's own forward with ``labels`` (Hugging
  Face's loss over full logits), ``loss.backward()``, ``torch.optim.AdamW.step()``;
  scoring: the same forward under ``torch.no_grad`` in batches of ``--rows`` rows.
- ``fedpeft``: FedLR's local step of one client (``Method.fit`` of a one-step round:
  the cohort path, vmapped over a cohort of one); scoring: the causal-LM scorer's
  response NLL, in batches of ``--rows`` rows (``same batches``) and with the default
  ``eval`` settings (``defaults``).

Each measurement runs in a fresh interpreter, so that nothing one leaves behind
(allocator arenas, caches) counts in another: the model is loaded, the high-water mark
of resident memory reset (``/proc/self/clear_refs``), the phase run once, and ``VmHWM``
read: the process's peak during the phase, model included. Linux only.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/memory.py [--lengths 192,512] [--rows 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from fedpeft.engines.memory import MIB, measure_peak_rss, peak_rss, rss

PROMPT_SHARE = 0.9
LORA = {"r": 8, "alpha": 16}
SCORED_ROWS = 64  # rows of the scored test set
CASES = [  # (phase, plain's measurement, fedpeft's)
    ("local step", "plain:step", "fedpeft:step"),
    ("scoring, same batches", "plain:score", "fedpeft:score"),
    ("scoring, eval defaults", "plain:score", "fedpeft:score-defaults"),
]


def synthetic_rows(rows: int, length: int, vocab: int, seed: int = 0):
    """Token ids ``(rows, length)`` and labels: the response (the last 10 %) labelled, the
    prompt :data:`fedpeft.data.task.IGNORE`."""
    from fedpeft.data.task import IGNORE

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    labels = ids.clone()
    labels[:, : int(PROMPT_SHARE * length)] = IGNORE
    return ids, labels


# ---------------------------------------------------------------- the plain loop


def plain_model():
    from peft import LoraConfig, get_peft_model

    from fedpeft.config import ModelConfig
    from fedpeft.models.backbone import load_backbone

    lm, _ = load_backbone(ModelConfig(backbone="bundled-smollm2"), lm_head=True)
    config = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], target_modules=["q_proj", "v_proj"])
    return get_peft_model(lm, config)


def plain(phase: str, rows: int, length: int) -> tuple[int, int | None]:
    """The plain loop's resident memory after loading and its peak during ``phase``."""
    model = plain_model()
    ids, labels = synthetic_rows(rows, length, model.config.vocab_size)
    mask = torch.ones_like(ids)
    if phase == "step":
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        model.train()

        def run():
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    else:
        test_ids, test_labels = synthetic_rows(SCORED_ROWS, length, model.config.vocab_size, seed=1)
        model.eval()

        @torch.no_grad()
        def run():
            for start in range(0, SCORED_ROWS, rows):
                part = slice(start, start + rows)
                model(input_ids=test_ids[part], attention_mask=torch.ones_like(test_ids[part]),
                      labels=test_labels[part])  # fmt: skip

    return rss(), measure_peak_rss(run)


# ---------------------------------------------------------------- fedpeft


def fedpeft_setup(rows: int):
    from fedpeft.config import load_config
    from fedpeft.experiment import attach_method, place
    from fedpeft.models.backbone import build_model

    cfg = load_config(
        None,
        {
            "model.backbone": "bundled-smollm2",
            "data.task": "causal_lm",
            "method": {"name": "fedlr", "lora": LORA},
            "train": {"batch_size": rows, "local_steps": 1, "lr": 1e-3, "device": "cpu"},
        },
    )
    model, tokenizer = build_model(cfg.model, 0, cfg.seed, "causal_lm")
    method, initial = attach_method(cfg, model)
    place(model, cfg.train)
    return cfg, model, tokenizer, method, initial


def encoded(rows: int, length: int, vocab: int, seed: int = 0):
    from fedpeft.data.task import Encoded

    ids, labels = synthetic_rows(rows, length, vocab, seed)
    lengths = torch.full((rows,), length)
    return Encoded(ids, lengths, labels, torch.full((rows,), int(PROMPT_SHARE * length)))


def fedpeft(phase: str, rows: int, length: int) -> tuple[int, int | None]:
    """fedpeft's resident memory after loading and its peak during ``phase``."""
    from fedpeft.engines.local import RoundContext
    from fedpeft.methods.base import ClientData, Job
    from fedpeft.models.causal import response_nll

    cfg, model, tokenizer, method, initial = fedpeft_setup(rows)
    vocab = model.backbone.config.vocab_size
    if phase == "step":
        client = ClientData(0, encoded(rows, length, vocab), encoded(1, length, vocab))
        shared = {n: initial[n] for n in method.shared_names}
        job = Job(shared, {}, client, seed=0, context=RoundContext(method.train))

        def run():
            method.fit_cohort(model, [job])

    else:
        test = encoded(SCORED_ROWS, length, vocab, seed=1)
        eval_cfg = cfg.eval if phase == "score-defaults" else cfg.eval.model_copy(update={"batch_size": rows})

        def run():
            response_nll(model, test, eval_cfg.batch_size, eval_cfg.batch_tokens)

    return rss(), measure_peak_rss(run)


# ---------------------------------------------------------------- the table


def child(which: str, rows: int, length: int) -> None:
    """One measurement, printed as JSON (the parent reads the last line)."""
    side, phase = which.split(":")
    t0 = time.perf_counter()
    loaded, growth = (plain if side == "plain" else fedpeft)(phase, rows, length)
    print(
        json.dumps(
            {"loaded": loaded, "peak": peak_rss(), "growth": growth, "seconds": time.perf_counter() - t0}
        )
    )


def measure_once(which: str, rows: int, length: int) -> dict:
    cmd = [sys.executable, __file__, "--child", which, "--rows", str(rows), "--lengths", str(length)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if done.returncode != 0:
        raise RuntimeError(f"{which} at {length} tokens failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(which: str, rows: int, length: int, repeats: int) -> dict:
    """The run with the median peak of ``repeats`` fresh processes (the C heap's reuse of
    freed memory varies from run to run)."""
    runs = sorted((measure_once(which, rows, length) for _ in range(repeats)), key=lambda r: r["peak"])
    return runs[len(runs) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="192,512", help="Tokens per row, comma-separated.")
    parser.add_argument("--rows", type=int, default=8, help="Rows per batch.")
    parser.add_argument("--repeats", type=int, default=1, help="Processes per measurement (median).")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.child:
        child(args.child, args.rows, lengths[0])
        return
    print(
        f"torch threads {torch.get_num_threads()}; {args.rows} rows per batch; peak resident memory (MiB), "
        f"the median of {args.repeats} process(es)"
    )
    columns = ["tokens per row", "phase", "plain peak", "fedpeft peak", "fedpeft / plain",
               "plain: above the loaded model", "fedpeft: above the loaded model"]  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("|---" * len(columns) + "|")
    cache: dict[tuple[str, int], dict] = {}
    for length in lengths:
        for phase, plain_key, fedpeft_key in CASES:
            for key in (plain_key, fedpeft_key):
                if (key, length) not in cache:
                    cache[key, length] = measure(key, args.rows, length, args.repeats)
            a, b = cache[plain_key, length], cache[fedpeft_key, length]
            print(
                f"| {length} | {phase} | {a['peak'] / MIB:,.0f} | {b['peak'] / MIB:,.0f} "
                f"| {b['peak'] / a['peak']:.2f} | {a['growth'] / MIB:,.0f} | {b['growth'] / MIB:,.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
