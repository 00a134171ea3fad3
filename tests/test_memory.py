"""The simulation keeps one backbone: memory grows with clients by their personal state only."""

import gc

import psutil
from transformers import BertModel

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


def test_200_clients_share_one_backbone(tiny_config, tmp_path):
    _run_clients(tiny_config, 20, str(tmp_path / "warm"))  # pays one-time costs (imports, buffers)
    setup, engine, rss_growth = _run_clients(tiny_config, 200, str(tmp_path / "big"))
    params = dict(setup.model.named_parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in params.values())
    personal_bytes = sum(params[n].numel() * params[n].element_size() for n in setup.method.personal_names)

    store = engine.personal
    assert len(store) == 200  # every client trained, holds and was evaluated with its own state
    assert sum(tensor_bytes(s) for s in store.values()) == 200 * personal_bytes
    assert personal_bytes * 50 < model_bytes  # the test is meaningful: states are small
    # exactly one backbone object alive, however many clients
    assert sum(type(o) is BertModel for o in gc.get_objects()) == 1
    # 200 model copies would cost 200 * model_bytes; the run grew by a small fraction of that
    assert rss_growth < 20 * model_bytes, (rss_growth, model_bytes)
