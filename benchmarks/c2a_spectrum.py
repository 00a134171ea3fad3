"""The singular values of trained adapters' up-projections: C2A's generated ``U_l`` (for
one test batch, labels unknown as at inference) beside a Houlsby adapter's ``up`` weight,
layer by layer. Shows how many directions each adapter actually uses (docs/c2a.md).

    .venv/bin/python benchmarks/c2a_spectrum.py RUN_DIR [RUN_DIR ...] [--layers 0,5] [--top 6]

``RUN_DIR``: a finished run of ``c2a`` or ``fedap`` (its ``adapter/`` export is read); the
C2A batch is the first ``eval.batch_size`` glosses of the run's global test set.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from fedpeft.data.sources import load_corpus
from fedpeft.exported import load_export
from fedpeft.peft.hyper import GeneratedAdapter


def generated_up(export, texts: list[str]) -> dict[int, torch.Tensor]:
    """Each layer's generated ``U_l`` for the batch ``texts`` (one per layer: both of its
    Houlsby sites share it)."""
    seen: dict[int, torch.Tensor] = {}

    def grab(module: GeneratedAdapter, args: tuple) -> None:
        seen[module.layer] = module.hyper.adapter(module.layer).detach().clone()

    hooks = [
        m.register_forward_pre_hook(grab) for m in export.model.modules() if isinstance(m, GeneratedAdapter)
    ]
    try:
        export.logits(texts, batch_size=len(texts))
    finally:
        for h in hooks:
            h.remove()
    return seen


def houlsby_up(export) -> dict[int, torch.Tensor]:
    """Each layer's first Houlsby site's ``up`` weight ``(d, r)``."""
    ups: dict[int, torch.Tensor] = {}
    for name, p in export.model.named_parameters():
        if name.endswith("attention.output.dense.adapter.up.weight"):
            ups[int(name.split("encoder.layer.")[1].split(".")[0])] = p.detach()
    return ups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--layers", default="0,5")
    ap.add_argument("--top", type=int, default=6)
    args = ap.parse_args()
    layers = [int(x) for x in args.layers.split(",")]
    for run in args.runs:
        export = load_export(run / "adapter")
        method = export.config.method.name
        if method == "c2a":
            batch = export.config.eval.batch_size
            texts = load_corpus(export.config.data, export.config.seed).test_texts[:batch]
            ups, what = generated_up(export, texts), f"generated U_l, first {batch} test glosses"
        elif method == "fedap":
            ups, what = houlsby_up(export), "Houlsby up-projection (attention site)"
        else:
            raise SystemExit(f"{run}: method {method!r}; expected c2a or fedap")
        print(f"{run} ({method}: {what})")
        for layer in layers:
            if layer not in ups:
                raise SystemExit(f"{run}: no layer {layer}; layers {sorted(ups)}")
            s = torch.linalg.svdvals(ups[layer].float())
            share = (s[:2] ** 2).sum() / (s**2).sum()
            values = ", ".join(f"{v:.2f}" for v in s[: args.top].tolist())
            print(f"  layer {layer}: singular values {values}, ...; top 2: {100 * share:.0f} % of the energy")


if __name__ == "__main__":
    main()
