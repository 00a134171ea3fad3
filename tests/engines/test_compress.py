"""Compressed messages (issue 34, item 6): each codec's round trip within its stated bound,
the bytes it records, error feedback's invariant, and runs that compress on the way."""

from __future__ import annotations

import math

import bitsandbytes.functional as bnb
import numpy as np
import pytest
import torch

from fedpeft.config import CodecConfig, CommConfig
from fedpeft.engines import compress as K
from fedpeft.experiment import build, make_engine, run
from fedpeft.flower import apps, codec
from fedpeft.methods.base import tensor_bytes
from fedpeft.report.results import read_records
from tests.helpers.flower import in_process_and_deployed
from tests.helpers.runs import whole_and_resumed

pytestmark = pytest.mark.usefixtures("forget_nodes")  # tests/conftest.py: the fake federation's nodes

N = 1000  # values in the tensor under test: not a multiple of the blocks, nor even


def sample(dtype=torch.float32) -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(N) * torch.logspace(-3, 1, N)  # magnitudes across four decades
    return x[torch.randperm(N)].reshape(40, 25).to(dtype)


def round_trip(x: torch.Tensor, cfg: CodecConfig, seed: int = 0) -> tuple[torch.Tensor, dict]:
    message = K.encode({"w": x}, cfg, seed)
    return K.decode(message, cfg, seed)["w"], message


def worst_code_distance(code: torch.Tensor) -> float:
    """The farthest a value in [-1, 1] can lie from its nearest code (rounding to nearest)."""
    code = code.sort().values.double()
    return max(float(code.diff().max()) / 2, float(code[0] + 1), float(1 - code[-1]))


def blocks_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each value's block's absolute maximum."""
    flat = x.reshape(-1).float()
    pad = -len(flat) % block
    absmax = torch.nn.functional.pad(flat, (0, pad)).abs().reshape(-1, block).amax(1)
    return absmax.repeat_interleave(block)[: len(flat)]


@pytest.mark.parametrize("codec, relative", [("fp16", 2.0**-11), ("bf16", 2.0**-8)])
def test_float_codecs_round_to_nearest(codec, relative):
    x = sample()
    got, message = round_trip(x, CodecConfig(codec=codec))
    assert got.dtype == x.dtype and got.shape == x.shape
    # round to nearest: within half a unit in the last place (plus fp16's subnormal step)
    assert ((got - x).abs() <= x.abs() * relative + 2.0**-25).all()
    assert tensor_bytes(message) == 2 * N + 4 * 3  # two bytes a value; meta: dtype and two dims


@pytest.mark.parametrize("block", [64, 256])
@pytest.mark.parametrize("codec", ["int8", "nf4"])
def test_blockwise_quantisers_stay_within_half_a_code_gap_of_the_block_absmax(codec, block):
    x = sample()
    got, message = round_trip(x, CodecConfig(codec=codec, block=block))
    code = bnb.create_dynamic_map(signed=True) if codec == "int8" else bnb.get_4bit_type("nf4", device="cpu")
    bound = blocks_absmax(x, block) * worst_code_distance(code) * (1 + 1e-5)
    assert ((got - x).reshape(-1).abs() <= bound).all()
    assert not torch.equal(got, x)  # it is lossy
    blocks = math.ceil(N / block)
    codes = N if codec == "int8" else math.ceil(N / 2)  # nf4: two codes a byte
    assert tensor_bytes(message) == codes + 4 * blocks + 4 * 3


def test_topk_sends_the_largest_values_exactly_with_their_positions():
    x = sample()
    got, message = round_trip(x, CodecConfig(codec="topk", fraction=0.05))
    kept = got != 0
    assert int(kept.sum()) == 50
    assert torch.equal(got[kept], x[kept])  # sent exactly
    assert x[~kept].abs().max() <= x[kept].abs().min()  # and they are the largest
    assert tensor_bytes(message) == 50 * (4 + 4) + 4 * 3  # float32 value + int32 position


def test_randk_positions_come_from_the_seed_alone():
    x = sample()
    cfg = CodecConfig(codec="randk", fraction=0.05)
    got, message = round_trip(x, cfg, seed=11)
    kept = got != 0
    assert int(kept.sum()) == 50 and torch.equal(got[kept], x[kept])
    assert tensor_bytes(message) == 50 * 4 + 4 * 3  # the values alone cross
    again = K.random_positions(N, 0.05, 11, "w")
    assert torch.equal(kept.reshape(-1).nonzero().squeeze(1), again)
    assert not torch.equal(again, K.random_positions(N, 0.05, 12, "w"))


def test_a_message_decodes_to_each_tensors_dtype_and_passes_integers_through():
    tensors = {"a": sample(torch.bfloat16), "b": torch.randn(3, 2, 2), "steps": torch.tensor([4, 5])}
    for name in ("fp16", "bf16", "int8", "nf4", "topk", "randk"):
        cfg = CodecConfig(codec=name, fraction=0.5)
        back = K.decode(K.encode(tensors, cfg, 1), cfg, 1)
        assert list(back) == list(tensors)
        assert {n: t.dtype for n, t in back.items()} == {n: t.dtype for n, t in tensors.items()}
        assert {n: t.shape for n, t in back.items()} == {n: t.shape for n, t in tensors.items()}
        assert torch.equal(back["steps"], tensors["steps"])


def test_fp16_refuses_a_value_it_cannot_hold():
    with pytest.raises(K.CompressionError, match=r"w: a value of magnitude 7e\+04 exceeds fp16"):
        K.encode({"w": torch.tensor([1.0, -7e4])}, CodecConfig(codec="fp16"))


@pytest.mark.parametrize("codec", ["topk", "randk", "int8", "nf4", "fp16", "bf16"])
def test_error_feedback_sends_and_keeps_exactly_the_update_plus_the_old_residual(codec):
    torch.manual_seed(1)
    cfg = CodecConfig(codec=codec, fraction=0.1, error_feedback=True)
    received = {"w": torch.randn(30, 20)}
    uplink = {"w": received["w"] + 0.01 * torch.randn(30, 20)}
    residual = {"w": 0.001 * torch.randn(30, 20)}
    sent = K.send_update(uplink, received, residual, cfg, seed=5)
    update = K.decode(sent.message, cfg, 5)["w"]
    true_sum = (uplink["w"] - received["w"]) + residual["w"]
    assert torch.allclose(update + sent.residual["w"], true_sum, atol=1e-7, rtol=0)
    assert not torch.equal(update, true_sum)  # lossy: there is a residual to keep
    if codec in K.SPARSIFIERS:  # a sparsifier's sent values are exact: so is the split
        assert torch.equal((update + sent.residual["w"])[update != 0], true_sum[update != 0])
    # the server adds the decoded update to what it sent
    got = K.receive_update(sent.message, received, cfg, 5)["w"]
    assert torch.allclose(got, received["w"] + update, atol=1e-6)
    # over rounds: what reached the server plus what is still kept is all the client's updates
    residual, delivered, updates = {"w": torch.zeros(30, 20)}, torch.zeros(30, 20), torch.zeros(30, 20)
    for rnd in range(4):
        step = {"w": received["w"] + 0.01 * torch.randn(30, 20)}
        sent = K.send_update(step, received, residual, cfg, seed=rnd)
        delivered += K.decode(sent.message, cfg, rnd)["w"]
        updates += step["w"] - received["w"]
        residual = sent.residual
    assert torch.allclose(delivered + residual["w"], updates, atol=1e-6, rtol=0)


def test_a_residual_of_another_shape_is_dropped_and_empty_or_scalar_tensors_travel():
    """A tensor whose shape changed since the last round (HETLoRA cuts ranks) starts a
    fresh residual; an empty tensor crosses as it is, a scalar like any other."""
    cfg = CodecConfig(codec="topk", fraction=0.5)
    sent = K.send_update({"w": torch.tensor([4.0, 3, 2, 1])}, {}, {"w": torch.ones(3)}, cfg, 0)
    assert torch.equal(sent.residual["w"], torch.tensor([0.0, 0, 2, 1]))
    tensors = {"empty": torch.zeros(0, 3), "scalar": torch.tensor(0.5)}
    for name in ("fp16", "int8", "nf4", "topk", "randk"):
        cfg = CodecConfig(codec=name)
        got = K.decode(K.encode(tensors, cfg, 1), cfg, 1)
        assert got["empty"].shape == (0, 3) and got["scalar"].shape == ()
        assert float(got["scalar"]) == pytest.approx(0.5, rel=0.01)


def test_without_error_feedback_nothing_is_kept_and_sparsifiers_default_to_it():
    assert K.error_feedback(CodecConfig(codec="topk")) and K.error_feedback(CodecConfig(codec="randk"))
    assert not K.error_feedback(CodecConfig(codec="int8"))
    assert not K.error_feedback(CodecConfig(codec="none", error_feedback=True))
    sent = K.send_update({"w": torch.ones(4)}, {"w": torch.zeros(4)}, {}, CodecConfig(codec="int8"), 0)
    assert sent.residual == {}


def test_the_config_takes_a_codec_by_name_and_refuses_sparse_downlinks():
    comm = CommConfig.model_validate({"uplink": "topk", "downlink": {"codec": "nf4", "block": 128}})
    assert (comm.uplink.codec, comm.downlink.codec, comm.downlink.block) == ("topk", "nf4", 128)
    with pytest.raises(ValueError, match=r"comm\.downlink randk: .*reference"):
        CommConfig.model_validate({"downlink": "randk"})
    with pytest.raises(ValueError, match="block"):
        CommConfig.model_validate({"uplink": {"codec": "int8", "block": 100}})


# ---------------------------------------------------------------- runs


def test_a_lossless_comm_config_is_the_uncompressed_run_bit_for_bit(tiny_config, tmp_path):
    plain = tiny_config(output_dir=str(tmp_path / "plain"))
    named = tiny_config(output_dir=str(tmp_path / "named"), **{"comm.uplink.codec": "none"})
    run(plain), run(named)
    a, b = read_records(plain.output_dir), read_records(named.output_dir)
    for key in ("loss", "global", "local", "bytes_up", "bytes_down"):
        assert [r[key] for r in a] == [r[key] for r in b]


def test_a_run_records_the_encoded_bytes_and_the_server_gets_the_decoded_update(tiny_config, tmp_path):
    """int8 up and fp16 down: each round's bytes are those of the encoded messages, and
    the run trains (the loss falls as the uncompressed run's does, near it)."""
    plain = tiny_config(output_dir=str(tmp_path / "plain"), **{"train.rounds": 3})
    squeezed = tiny_config(
        output_dir=str(tmp_path / "squeezed"),
        **{"train.rounds": 3, "comm.uplink.codec": "int8", "comm.downlink.codec": "fp16"},
    )
    setup = build(squeezed)
    shared = {n: p for n, p in setup.model.named_parameters() if n in set(setup.method.shared_names)}
    int8_bytes = sum(p.numel() + 4 * math.ceil(p.numel() / 64) + 4 * (1 + p.dim()) for p in shared.values())
    fp16_bytes = sum(2 * p.numel() + 4 * (1 + p.dim()) for p in shared.values())
    run(plain), run(squeezed, setup=setup)
    a, b = read_records(plain.output_dir), read_records(squeezed.output_dir)
    for ra, rb in zip(a, b, strict=True):
        assert rb["clients"] == ra["clients"]
        assert rb["bytes_up"] == len(rb["clients"]) * int8_bytes
        assert rb["bytes_down"] - ra["bytes_down"] == len(rb["clients"]) * (fp16_bytes - tensor_bytes(shared))
        assert rb["bytes_up"] < ra["bytes_up"] / 3
        assert rb["loss"] == pytest.approx(ra["loss"], rel=0.05)


@pytest.mark.parametrize("codec", ["topk", "randk"])
def test_a_sparsifier_keeping_every_value_is_the_uncompressed_run(tiny_config, tmp_path, codec):
    """At fraction 1 nothing is left out: the server rebuilds each update to float
    rounding (what was received + (trained - received)), and the run follows the plain one."""
    plain = tiny_config(output_dir=str(tmp_path / "plain"), **{"train.rounds": 3})
    whole = tiny_config(
        output_dir=str(tmp_path / "whole"),
        **{"train.rounds": 3, "comm.uplink": {"codec": codec, "fraction": 1.0}},
    )
    run(plain), run(whole)
    a, b = read_records(plain.output_dir), read_records(whole.output_dir)
    for ra, rb in zip(a, b, strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-4)
        assert rb["global"]["accuracy"] == pytest.approx(ra["global"]["accuracy"], abs=1e-9)


def test_topk_keeps_its_residual_on_the_client_and_resumes_it(tiny_config, tmp_path):
    """Error feedback's residual is the client's: stored beside its personal state, never
    shown to the method or exported; a run killed mid-round resumes to the same end."""
    extra = {"train.rounds": 4, "comm.uplink": {"codec": "topk", "fraction": 0.1}}
    a, b, (whole, cut) = whole_and_resumed(tiny_config, tmp_path, **extra)  # killed in round 3
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["local"] for r in a] == [r["local"] for r in b]
    # the clients' states as the run left them: the residual beside the personal state,
    # which is all the method is given, and every tensor of it the uninterrupted run's
    engine, straight = make_engine(build(cut), None, None), make_engine(build(whole), None, None)
    engine.start(resume=True)
    straight.start(resume=True)
    trained = [c for c in engine.clients if c.cid in engine.personal]
    assert trained and sorted(c.cid for c in trained) == sorted(straight.personal.keys())
    for client in trained:
        stored = engine.personal[client.cid]
        residual = {k: v for k, v in stored.items() if k.startswith(K.RESIDUAL)}
        assert residual and any(bool(v.abs().sum() > 0) for v in residual.values())
        assert sorted(k[len(K.RESIDUAL) :] for k in residual) == sorted(engine.method.shared_names)
        assert not any(k.startswith(K.RESIDUAL) for k in engine.personal_of(client))
        kept = straight.personal[client.cid]
        assert stored.keys() == kept.keys() and all(torch.equal(t, kept[n]) for n, t in stored.items())


@pytest.mark.parametrize(
    "method, comm",
    [
        ({"name": "fedlr"}, {"uplink": {"codec": "topk", "fraction": 0.1}, "downlink": "int8"}),
        pytest.param(  # the slow tier (CI runs it): the default tier stays under its 10 minutes
            {"name": "pf2lora"}, {"uplink": "nf4", "downlink": "bf16"}, marks=pytest.mark.slow
        ),
    ],
)
def test_the_flower_path_compresses_as_in_process(tiny_config, tmp_path, method, comm):
    """The same runs through Flower's ClientApp and ServerApp: the same metrics, the same
    encoded bytes recorded (Flower's framing on top on the wire), the encoded parts of the
    shared tensors in every update, and the residual kept on the node alone."""
    over = {"comm": comm, "train.rounds": 3, "method": method}
    a, b, grid, (local, flower) = in_process_and_deployed(tiny_config, tmp_path, **over)
    for ra, rb in zip(a, b, strict=True):
        assert rb["clients"] == ra["clients"] and "dropped" not in rb
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-6)
        assert rb["global"] == pytest.approx(ra["global"], rel=1e-6)
        assert rb["local"] == pytest.approx(ra["local"], rel=1e-6)
        assert (rb["payload_bytes_up"], rb["payload_bytes_down"]) == (ra["bytes_up"], ra["bytes_down"])
        assert rb["bytes_up"] > rb["payload_bytes_up"]
    # the recorded payload is the packed tensor bytes the messages serialise (values,
    # indices, scales); the name index beside them and Flower's framing are the rest of
    # bytes_up. Over every training message and reply of the run:
    trains = [m for m in grid.sent if m.metadata.message_type == "train"]
    replies = [m for m in grid.replies if "uplink" in m.content]

    def array_bytes(messages):
        packed = [rec[codec.PACKED] for m in messages for rec in m.content.array_records.values()]
        return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in packed)

    assert array_bytes(replies) == sum(r["payload_bytes_up"] for r in b)
    assert array_bytes(trains) == sum(r["payload_bytes_down"] for r in b)
    # and bytes_up / bytes_down are the serialised sizes (the deflated objects Flower pushes
    # and pulls) of exactly those messages: a join's setup, sent with an evaluation, counted
    # too, and no other evaluation traffic
    joins = [
        m.content["join"] for m in grid.sent if "join" in m.content and m.metadata.message_type != "train"
    ]
    assert sum(map(codec.wire_bytes, replies)) == sum(r["bytes_up"] for r in b)
    down = sum(map(codec.wire_bytes, trains)) + sum(map(codec.wire_bytes, joins))
    assert down == sum(r["bytes_down"] for r in b)
    node = next(iter(apps._nodes.values()))
    shared = set(node.method.shared_names)
    updates = [codec.from_record(m.content["uplink"]) for m in grid.replies if "uplink" in m.content]
    assert updates and all(set(K.names_in(u)) == shared and set(u) != shared for u in updates)
    for m in grid.sent + grid.replies:
        names = {k for rec in m.content.array_records.values() for k in codec.from_record(rec)}
        assert not any(K.RESIDUAL in n for n in names)
    saved = torch.load(tmp_path / "node0" / "client-0-personal.pt", weights_only=True)["value"]
    kept = set(next(iter(saved.values())))
    feedback = K.error_feedback(flower.comm.uplink)
    assert feedback == ({k for k in kept if k.startswith(K.RESIDUAL)} == {K.RESIDUAL + n for n in shared})


def test_secure_aggregation_refuses_a_compressed_uplink(tiny_config):
    with pytest.raises(ValueError, match=r"comm\.uplink int8: deploy\.secure_aggregation"):
        tiny_config(**{"comm.uplink": "int8", "deploy.secure_aggregation": True})
