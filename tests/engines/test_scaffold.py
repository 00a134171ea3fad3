"""SCAFFOLD (issue 32; ``train.correction: scaffold``): the controls of a two-client run
worked by hand, a cohort equal to its clients one at a time, the bytes counted, and the
refusals. A resumed run equals an uninterrupted one: ``tests/engines/test_resume.py``
(``fedlr+scaffold``)."""

import pytest
import torch

from fedpeft.config import ConfigError, TrainConfig
from fedpeft.data.task import Encoded
from fedpeft.engines.inprocess import InProcessEngine, RunPlan
from fedpeft.engines.local import CONTROL, Job, RoundContext, row_mean
from fedpeft.engines.scaffold import PREFIX
from fedpeft.experiment import build
from fedpeft.methods.base import ClientData, Method, MethodConfig


class Scalar(torch.nn.Module):
    """A model of one number ``w`` whose loss on a row labelled ``t`` is ``(w - t)^2 / 2``:
    its gradient ``w - t`` is worked by hand."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, attention_mask):
        return self.w.expand(input_ids.shape[0])

    def loss(self, out, batch):
        return row_mean(0.5 * (out - batch["labels"].float()) ** 2, batch)


class Plain(Method):
    name = "plain"


def _client(cid: int, target: int, rows: int = 4) -> ClientData:
    data = Encoded(
        torch.ones(rows, 1, dtype=torch.long), torch.ones(rows, dtype=torch.long), torch.full((rows,), target)
    )
    return ClientData(cid, data, data.subset([]))


class NoScores:
    def score(self, model, data):
        return {}


def _engine(correction: str = "scaffold") -> InProcessEngine:
    model = Scalar()
    train = TrainConfig(
        optimizer="sgd", lr=0.5, local_steps=2, batch_size=4, max_grad_norm=None, correction=correction
    )
    method = Plain(MethodConfig(name="plain"), train)
    method.prepare(model)
    clients = [_client(0, 1), _client(1, 3)]
    plan = RunPlan(rounds=2, clients_per_round=2, seed=0, eval_local=False)
    return InProcessEngine(
        model, method, clients, clients[0].test, plan, scorer=NoScores(), memory_check=False
    )


def test_two_clients_controls_are_worked_by_hand():
    """Two clients, targets 1 and 3, x = 0, SGD at lr 0.5 for K = 2 steps, both sampled
    every round (N = S = 2), clipping off.

    Round 1 (c = c_i = 0): client 1 goes 0 -> 0.5 -> 0.75 (gradients -1, -0.5), so
    c_1 = (0 - 0.75) / (2 * 0.5) = -0.75, their mean; client 2 goes 0 -> 1.5 -> 2.25, c_2 =
    -2.25. Server: x = 1.5, c = 0 + (-0.75 - 2.25) / 2 = -1.5.
    Round 2: client 1 steps along (w - 1) - c_1 + c = w - 1.75: 1.5 -> 1.625 -> 1.6875;
    c_1 = -0.75 + 1.5 + (1.5 - 1.6875) = 0.5625 (its gradients 0.5, 0.625: their mean).
    Client 2 along (w - 3) + 0.75: 1.5 -> 1.875 -> 2.0625; c_2 = -2.25 + 1.5 - 0.5625 =
    -1.3125. Server: x = 1.875, c = -1.5 + (1.3125 + 0.9375) / 2 = -0.375 (= the mean of
    the c_i, as it stays while every client is sampled)."""
    engine = _engine()
    records = engine.run()
    server = engine.server
    assert server.tensors["w"].item() == pytest.approx(1.875)
    assert server.extras[PREFIX + "w"].item() == pytest.approx(-0.375)
    assert engine.personal[0][CONTROL + "w"].item() == pytest.approx(0.5625)
    assert engine.personal[1][CONTROL + "w"].item() == pytest.approx(-1.3125)
    # each client receives x and c and sends y and dc: four floats of 4 bytes each way per round
    assert [r["bytes_down"] for r in records] == [16, 16]
    assert [r["bytes_up"] for r in records] == [16, 16]


def test_round_one_is_fedavg_and_then_the_correction_moves_the_clients():
    """With c = c_i = 0 round 1 is FedAvg's; afterwards the clients step along the corrected
    gradient, so they end elsewhere (here the server's x happens to agree: the losses are
    quadratic with one curvature, and the corrections cancel in the mean)."""
    scaffold, plain = _engine(), _engine("none")
    scaffold.run()
    plain.run()
    assert scaffold.server.tensors["w"].item() == pytest.approx(plain.server.tensors["w"].item())
    assert not any(k.startswith(PREFIX) for k in plain.server.extras)
    assert CONTROL + "w" not in plain.personal[0]


def test_a_cohort_trains_each_client_as_alone(tiny_config, tmp_path):
    """Three clients' corrected rounds in one cohort equal each client's round alone, their
    controls too (the cohort loop's tolerance, tests/engines/test_cohort.py)."""
    cfg = tiny_config(
        **{"train.optimizer": "sgd", "train.lr": 0.05, "train.correction": "scaffold"},
        output_dir=str(tmp_path),
    )
    setup = build(cfg)
    method, model = setup.method, setup.model
    received = {n: setup.initial[n] for n in method.shared_names}
    control = {n: torch.randn_like(t) * 0.01 for n, t in received.items()}
    jobs, context = [], RoundContext(method.train)
    for client in setup.clients[:3]:
        own = {CONTROL + n: torch.randn_like(t) * 0.01 for n, t in received.items()}
        jobs.append(Job(received, own, client, seed=client.cid + 7, rnd=2, control=control, context=context))
    together = method.fit_cohort(model, jobs)
    for job, joint in zip(jobs, together, strict=True):
        (alone,) = method.fit_cohort(model, [job])
        for part in ("uplink", "personal", "control"):
            mine, theirs = getattr(alone, part), getattr(joint, part)
            assert mine.keys() == theirs.keys() and mine
            for n, t in mine.items():
                torch.testing.assert_close(theirs[n], t, rtol=1e-4, atol=1e-5)
    # and the correction did something: a round without it ends elsewhere
    (uncorrected,) = method.fit_cohort(
        model, [Job(received, {}, jobs[0].client, jobs[0].seed, 2, context=context)]
    )
    assert any(not torch.allclose(uncorrected.uplink[n], t) for n, t in together[0].uplink.items())


def test_scaffold_refuses_what_it_cannot_correct(tiny_config):
    with pytest.raises(ConfigError, match="train.optimizer: sgd"):
        tiny_config(**{"train.correction": "scaffold"})
    with pytest.raises(ConfigError, match="secure_aggregation"):
        tiny_config(**{"train.correction": "scaffold", "train.optimizer": "sgd",
                       "deploy.secure_aggregation": True})  # fmt: skip
    for name, why in (("local", "shares no tensors"), ("fedrep", "phases"), ("fdlora", "outer")):
        cfg = tiny_config(**{"train.correction": "scaffold", "train.optimizer": "sgd", "method.name": name})
        with pytest.raises(ConfigError, match=f"method {name}: .*{why}"):
            build(cfg)


def test_a_node_holds_its_new_control_until_the_server_applied_it():
    """On a node, the new ``c_i`` waits as pending; the next training message says which
    round's control update the server applied: that one's pending control is taken in,
    any other dropped (the control the round started from stays)."""
    from fedpeft.engines import scaffold

    before = {"w": torch.ones(2), CONTROL + "w": torch.full((2,), 0.5)}
    after = {"w": torch.full((2,), 2.0), CONTROL + "w": torch.full((2,), 0.75)}
    kept = scaffold.held(before, after, 3)
    assert torch.equal(kept[CONTROL + "w"], before[CONTROL + "w"]) and torch.equal(kept["w"], after["w"])
    assert torch.equal(scaffold.confirmed(kept, 3)[CONTROL + "w"], after[CONTROL + "w"])  # applied
    assert torch.equal(scaffold.confirmed(kept, 2)[CONTROL + "w"], before[CONTROL + "w"])  # lost
    assert set(scaffold.confirmed(kept, 2)) == set(before)
    first = scaffold.held({"w": torch.ones(2)}, after, 1)  # no control yet: c_i = 0 until confirmed
    assert torch.equal(first[CONTROL + "w"], torch.zeros(2))


@pytest.mark.slow  # ~15 s, a Flower run: out of the default tier for its 10 minutes (CI's slow tier runs it)
def test_on_flower_the_servers_control_stays_the_mean_of_the_clients_when_a_reply_is_lost(
    tiny_config, tmp_path
):
    """Client 0 trains in round 1 (and keeps its state) but its reply is refused: the server
    never adds its ``dc_0``. After three rounds the server's ``c`` is still ``(1/N) sum c_i``
    over the controls the nodes will train with (SCAFFOLD's invariant)."""
    from fedpeft.engines import scaffold
    from fedpeft.engines.checkpoint import load_checkpoint
    from fedpeft.experiment import fingerprint
    from fedpeft.flower import codec
    from fedpeft.report.results import read_records
    from tests.helpers.configs import SCAFFOLD
    from tests.helpers.flower import deploy, serve, wrapped_handler

    cfg = tiny_config(**SCAFFOLD, **{"train.rounds": 3, "train.clients_per_round": 4})
    grid = deploy(cfg, tmp_path)

    def losing(real_train, message, context):
        reply = real_train(message, context)
        if context.node_config["partition-id"] == 0 and message.content["config"]["round"] == 1:
            control = codec.from_record(reply.content["control"])
            del control[next(iter(control))]  # refused whole: the node has already kept its state
            reply.content["control"] = codec.to_record(control)
        return reply

    with wrapped_handler("train", losing):
        serve(grid)
    assert list(read_records(cfg.output_dir)[0]["dropped"]) == ["0"]
    server = load_checkpoint(cfg.output_dir / "checkpoint.pt", fingerprint(cfg)).server
    setup = build(cfg)
    n = cfg.partition.num_clients
    total = {
        name: torch.zeros_like(server.tensors[name], dtype=torch.float64)
        for name in setup.method.shared_names
    }
    for cid in range(n):
        snapshots = torch.load(tmp_path / f"node{cid}" / f"client-{cid}-personal.pt", weights_only=True)[
            "value"
        ]
        personal = scaffold.confirmed(snapshots[max(snapshots)], scaffold.applied_round(server, cid))
        for name in total:
            total[name] += personal[CONTROL + name].double()
    assert any(float(server.extras[PREFIX + name].abs().max()) > 0 for name in total)
    for name, t in total.items():
        torch.testing.assert_close(server.extras[PREFIX + name].double(), t / n, rtol=1e-5, atol=1e-7)
