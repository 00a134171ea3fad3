"""The simulation keeps one backbone: memory grows with clients by their personal state only.

The measurement runs in a fresh interpreter: resident memory is a property of a whole
process, and what other tests left behind (arenas, threads, caches) must not count.
"""

import copy
import gc
import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from transformers import BertModel

from fedpeft.config import parse_config
from fedpeft.engines import inprocess
from fedpeft.experiment import build, run
from fedpeft.methods.base import tensor_bytes


def _run_clients(tiny_config, num_clients: int, out: str):
    """Run Local-only (all state personal) over ``num_clients``; return (setup, engine, rss growth)."""
    cfg = tiny_config(
        **{
            "method": {"name": "local", "trainable": "lora", "lora": {"r": 2}},
            "data": {"source": "wordnet", "max_samples": 12 * num_clients, "max_test_samples": 8},
            "partition": {"scheme": "iid", "num_clients": num_clients, "local_test_fraction": 0.2},
            "train": {"rounds": 1, "clients_per_round": num_clients, "local_steps": 1, "batch_size": 4},
            "checkpoint": False,
            "output_dir": out,
        }
    )
    setup = build(cfg)
    engines = []
    real_init = inprocess.InProcessEngine.__init__

    def keep(self, *a, **k):  # a handle on the engine, to inspect its client store
        real_init(self, *a, **k)
        engines.append(self)

    gc.collect()
    rss_before = psutil.Process().memory_info().rss
    inprocess.InProcessEngine.__init__ = keep
    try:
        run(cfg, setup=setup)
    finally:
        inprocess.InProcessEngine.__init__ = real_init
    gc.collect()
    return setup, engines[0], psutil.Process().memory_info().rss - rss_before


def _measure(backbone: str, out: str) -> dict:
    """The 200-client run after a 20-client warm-up (which pays one-time costs)."""
    from tests.helpers.configs import TINY

    def tiny_config(**overrides):
        data = copy.deepcopy(TINY) | {"model": {"backbone": backbone}}
        data.update(overrides)
        return parse_config(data, "tiny")

    _run_clients(tiny_config, 20, str(Path(out) / "warm"))
    setup, engine, rss_growth = _run_clients(tiny_config, 200, str(Path(out) / "big"))
    params = dict(setup.model.named_parameters())
    store = engine.personal
    return {
        "model_bytes": sum(p.numel() * p.element_size() for p in params.values()),
        "personal_bytes": sum(
            params[n].numel() * params[n].element_size() for n in setup.method.personal_names
        ),
        "clients_stored": len(store),
        "stored_bytes": sum(tensor_bytes(s) for s in store.values()),
        "backbones_alive": sum(type(o) is BertModel for o in gc.get_objects()),
        "rss_growth": rss_growth,
    }


@pytest.mark.slow  # about 70 s of a 2-core machine: a scale test, run by .ci/run
def test_200_clients_share_one_backbone(tiny_backbone, tmp_path):
    proc = subprocess.run(  # a module of the tests package, run from the checkout's root
        [sys.executable, "-m", "tests.engines.test_memory", str(tiny_backbone), str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    assert m["clients_stored"] == 200  # every client trained, holds and was evaluated with its own state
    assert m["stored_bytes"] == 200 * m["personal_bytes"]
    assert m["personal_bytes"] * 50 < m["model_bytes"]  # the test is meaningful: states are small
    assert m["backbones_alive"] == 1  # exactly one backbone object alive, however many clients
    # 200 model copies would cost 200 * model_bytes; the run grew by a small fraction of that
    assert m["rss_growth"] < 20 * m["model_bytes"], m


if __name__ == "__main__":
    print(json.dumps(_measure(sys.argv[1], sys.argv[2])))
