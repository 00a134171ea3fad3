"""Training a decoder's LoRA adapters: memory and tokens per second at each precision, one
client and cohorts, with and without gradient checkpointing, all in one run (issue 36).

Each row is one configuration of the frozen backbone, trained by fedpeft's own local
round (``Method.fit_cohort``: FedLR, LoRA r 16 on query/value) on synthetic clients
(random token ids, every row ``--length`` tokens, all of them scored):

- precision ``fp32``, ``bf16`` (``model.dtype: bfloat16``: frozen weights bfloat16,
  bfloat16 autocast), ``int8`` (LLM.int8) and ``nf4`` (4-bit NormalFloat, computing in
  float32 on a CPU, bfloat16 on a GPU), through bitsandbytes;
- one client, and a cohort of ``--cohort`` clients (``vmap``, or ``folded``: the frozen
  backbone once on the folded batch; a quantised or checkpointed backbone only folds);
- ``model.gradient_checkpointing`` off and on.

Each configuration runs in a fresh process (spawned), so that one's memory is not the
next one's baseline: ``weights MB`` is what the model holds (parameters and buffers),
``peak MB`` the growth of memory at its peak during the timed round (CUDA's allocator
peak; on a CPU the resident set's high-water mark), ``tokens/s`` the real tokens trained
per second of a round of ``--steps`` steps after one warm-up step.

    .venv/bin/python benchmarks/decoders.py [--device auto] [--length 64] [--batch 4] [--steps 2] [--cohort 4]
    .venv/bin/python benchmarks/decoders.py --backbone random-1b --length 512   # a GPU: 1 B params, random

``--backbone``: ``bundled-smollm2`` (SmolLM2-135M, the default) or ``random-1b``, a
Llama-3.2-1B-shaped decoder (hidden 2048, 16 layers, 1.1 B parameters with SmolLM2's
vocabulary) with random weights, written once under ``--work`` (nothing is downloaded).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from pathlib import Path

PRECISIONS = {  # name: (model.dtype, model.quantization)
    "fp32": ("float32", "none"),
    "bf16": ("bfloat16", "none"),
    "int8": ("float32", "int8"),
    "nf4": ("float32", "nf4"),
}


#: Llama-3.2-1B's shape (with SmolLM2's vocabulary: 1.1 B parameters)
SHAPE_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8}  # fmt: skip


def random_decoder(out: Path, shape: dict) -> Path:
    """A Llama-shaped decoder of ``shape`` with random weights and SmolLM2's tokenizer,
    saved to ``out`` (once; bfloat16 on disk): a model of that size without a download."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from fedpeft.models.backbone import SMOLLM2_GGUF, bundled_smollm2_dir

    if (out / "config.json").is_file():
        return out
    tok = AutoTokenizer.from_pretrained(str(bundled_smollm2_dir()), gguf_file=SMOLLM2_GGUF)
    config = LlamaConfig(
        vocab_size=len(tok), max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **shape,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    print(f"writing a random {model.num_parameters() / 1e9:.2f} B decoder to {out}", flush=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def backbone_path(args: argparse.Namespace) -> str:
    """Where each configuration loads the backbone from: the bundled SmolLM2's GGUF
    dequantised once to safetensors (as a quantised run loads it; reading the GGUF anew
    in every process would take longer than the measurement), the random 1 B decoder, or
    the path given."""
    if args.backbone == "random-1b":
        return str(random_decoder(args.work / "random-1b", SHAPE_1B))
    if args.backbone == "bundled-smollm2":
        from fedpeft.models.backbone import SMOLLM2_GGUF, bundled_smollm2_dir, dequantised_gguf

        return str(dequantised_gguf(str(bundled_smollm2_dir()), SMOLLM2_GGUF))
    return args.backbone


def clients(count: int, rows: int, length: int, vocab: int, device):
    """``count`` synthetic clients: ``rows`` rows of ``length`` random tokens, all scored."""
    import torch

    from fedpeft.data.task import Encoded
    from fedpeft.methods.base import ClientData

    g = torch.Generator().manual_seed(1)
    out = []
    for cid in range(count):
        ids = torch.randint(10, vocab, (rows, length), generator=g)
        data = Encoded(ids, torch.full((rows,), length), ids.clone()).to(device)
        out.append(ClientData(cid, data, data.subset(torch.arange(1))))
    return out


def measure(row: dict, args: argparse.Namespace) -> dict:
    """One configuration, in its own process: weights, peak memory and tokens/s of a round."""
    import torch

    from fedpeft.config import load_config
    from fedpeft.engines.local import Job, RoundContext, enable_checkpointing, needs_plain_autograd
    from fedpeft.engines.memory import measure_peak_cuda, measure_peak_rss, release_free_heap
    from fedpeft.experiment import attach_method, place
    from fedpeft.models.backbone import build_model
    from fedpeft.models.device import resolve_device

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype, quantization = PRECISIONS[row["precision"]]
    device = resolve_device(args.device)
    if quantization == "nf4" and device.type == "cuda":
        dtype = "bfloat16"  # QLoRA's compute dtype on a GPU
    targets = args.targets.split(",")
    cfg = load_config(None, {
        "data": {"task": "causal_lm"},
        "model": {"backbone": args.backbone_path, "dtype": dtype, "quantization": quantization,
                  "gradient_checkpointing": row["checkpointing"]},
        "method": {"name": "fedlr", "lora": {"r": 16, "alpha": 32, "target_modules": targets}},
        "train": {"lr": 1e-4, "local_steps": args.steps, "batch_size": args.batch, "device": args.device,
                  "cohort_mode": row["mode"]},
    })  # fmt: skip
    model, _ = build_model(cfg.model, 0, cfg.seed, "causal_lm", str(device))
    method, initial = attach_method(cfg, model)
    place(model, cfg.train)
    if row["checkpointing"]:
        enable_checkpointing(model)
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    vocab = model.backbone.get_input_embeddings().weight.shape[0]
    cohort = clients(row["clients"], args.batch * args.steps, args.length, vocab, device)
    shared = {n: initial[n] for n in method.shared_names}

    def round_of(steps: int):
        context = RoundContext(cfg.train.model_copy(update={"local_steps": steps}))
        method.fit_cohort(model, [Job(shared, {}, c, c.cid, context=context) for c in cohort])
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    round_of(1)  # warm-up: kernels, allocator
    if device.type == "cuda":
        peak = measure_peak_cuda(lambda: round_of(args.steps), device)
    else:
        release_free_heap()
        peak = measure_peak_rss(lambda: round_of(args.steps))
    start = time.perf_counter()
    round_of(args.steps)
    seconds = time.perf_counter() - start
    tokens = row["clients"] * args.steps * args.batch * args.length
    if row["clients"] == 1:
        kernel = "-"
    else:
        kernel = "folded" if row["mode"] == "folded" or needs_plain_autograd(model) else "vmap"
    return {**row, "weights_mb": weights / 2**20, "peak_mb": (peak or 0) / 2**20,
            "tokens_s": tokens / seconds, "kernel": kernel, "device": str(device)}  # fmt: skip


def rows(args: argparse.Namespace) -> list[dict]:
    """Every configuration; on a CPU without bfloat16 kernels (``--bf16-alone``) bfloat16 one
    client at a time only: it computes 30 times slower than float32 there."""
    out = []
    for precision in args.precisions.split(","):
        quantised = PRECISIONS[precision][1] != "none"
        for checkpointing in (False, True):
            out.append({"precision": precision, "clients": 1, "mode": "auto", "checkpointing": checkpointing})
            if precision == "bf16" and args.bf16_alone:
                continue
            modes = ["auto"] if quantised or checkpointing else ["auto", "folded"]  # auto is vmap here
            out += [
                {"precision": precision, "clients": args.cohort, "mode": m, "checkpointing": checkpointing}
                for m in modes
            ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backbone", default="bundled-smollm2", help="bundled-smollm2, random-1b or a path")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--length", type=int, default=64, help="tokens a row")
    ap.add_argument("--batch", type=int, default=4, help="rows a step")
    ap.add_argument("--steps", type=int, default=2, help="timed steps a round")
    ap.add_argument("--cohort", type=int, default=4, help="clients of a cohort")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--bf16-alone", action="store_true", help="bfloat16 one client at a time only (a CPU)")
    ap.add_argument("--work", type=Path, default=Path("benchmarks/results/decoders"))
    ap.add_argument(
        "--targets",
        default="query,value",
        help="LoRA's modules: query,value (the default), all-linear, or names",
    )
    args = ap.parse_args()
    args.backbone_path = backbone_path(args)
    print(f"{args.backbone}, LoRA r 16 ({args.targets}), rows of {args.length} tokens, {args.batch} rows a "
          f"step, {args.steps} steps\n")  # fmt: skip
    print(
        "| precision | clients | cohort | checkpointing | weights MB | peak MB | tokens/s | vs fp32 alone |"
    )
    print("|---|---|---|---|---|---|---|---|")
    base = None
    ctx = mp.get_context("spawn")
    for row in rows(args):
        with ctx.Pool(1) as pool:
            got = pool.apply(measure, (row, args))
        if base is None:
            base = got["tokens_s"]
        cells = [got["precision"], got["clients"], got["kernel"], "on" if got["checkpointing"] else "off",
                 f"{got['weights_mb']:.0f}", f"{got['peak_mb']:.0f}", f"{got['tokens_s']:.0f}",
                 f"{got['tokens_s'] / base:.2f}x"]  # fmt: skip
        print("| " + " | ".join(map(str, cells)) + " |", flush=True)
    print(f"\ndevice: {got['device']}")


if __name__ == "__main__":
    main()
