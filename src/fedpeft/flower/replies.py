"""Every reply a node sends, checked before the server uses any of it (issue 72).

A node is another party: its reply can be malformed by a bug, by another version of
fedpeft or on purpose. The server reads every kind of reply through this module: the
roll call (:func:`read_roll_call`), a training reply (:func:`read_fit`), an evaluation
reply (:func:`read_evaluation`) and the replies of SecAgg+'s stages
(:func:`check_secure_reply`). A check that fails raises a
:class:`~fedpeft.flower.codec.ReplyError` whose one line names the field at fault; the
server drops that client for the round with that reason (the round record's ``dropped``,
or ``eval_failed`` for an evaluation; a roll call's node is ignored that round) and goes
on. A reply never stops the server.

What is checked:

- the records and fields the protocol names, and their types; nothing else;
- counts: finite whole numbers, positive, and a client's examples no more than its
  node said at the roll call (the count the server knows);
- metric names: a known set (a training reply's: what fedpeft's own client sends,
  :data:`FIT_METRICS`; an evaluation's: the task's scorer's, :func:`score_names`); an
  unknown name is refused by name;
- tensors, before any is allocated at the size a reply claims: the uplink's packed
  bytes no more than the expected update can take under ``comm.uplink``
  (:func:`uplink_bound`); the shapes its index and its codec's ``#meta`` claim no larger
  than the expected tensors' (:func:`check_claims`); then, decoded, exactly the expected
  names, shapes and dtypes (:func:`fedpeft.flower.codec.check_tensors`).

A rule of trust lives here too: a client's weight in an example-weighted mean is at most
the count the server knows and at most ``deploy.max_weight_share`` of the round
(:func:`cap_results`): a node that lies about its size at the roll call gains that share
and no more. Who may hold which client id is :mod:`fedpeft.flower.members`'.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np
import torch
from flwr.app import ArrayRecord, Message
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

from fedpeft.config import CodecConfig
from fedpeft.engines import compress
from fedpeft.flower.codec import ReplyError, describe, from_record, npy_layout
from fedpeft.methods.base import FitResult, Tensors
from fedpeft.metrics import generation, qa, tagging
from fedpeft.metrics.classification import scores as classification_scores

#: A training reply's metrics: what fedpeft's clients send. The local loop's ``loss``,
#: ``steps``, ``tokens``, ``time_step`` (engines/local/loop.py); methods' own (``rank``:
#: HETLoRA, FlexLoRA, FLoRA; ``personal_loss``: FDLoRA; ``head_*``, ``body_steps``,
#: ``time_step_head``: FedRep; ``uplink_ratio``: FedKD); and the node's
#: (flower/apps.py, node.py): ``num_examples``, ``time_fit``, ``fitted`` (adaptive
#: clipping's report). A method that reports a new metric adds it here.
FIT_METRICS = frozenset(
    {"loss", "steps", "tokens", "time_step", "rank", "personal_loss", "head_steps", "body_steps",
     "head_loss", "time_step_head", "uplink_ratio", "num_examples", "time_fit", "fitted"}
)  # fmt: skip
#: Per-client readouts (``Method.readout``): HETLoRA's, FlexLoRA's, FLoRA's ``rank``;
#: PF2LoRA's effective ranks.
READOUTS = frozenset({"rank", "rank_mean", "rank_min", "rank_max"})
#: SecAgg+ carries the readouts among the fit metrics, prefixed (flower/apps.py)
SECURE_METRICS = FIT_METRICS | {f"readout.{name}" for name in READOUTS}

#: the name of an extra client model's scores (``local_<name>``, ``Method.extra_eval_states``)
EXTRA_NAME = re.compile(r"[A-Za-z0-9_]{1,40}")


# ---------------------------------------------------------------- fields


def number(value, what: str) -> float:
    """``value`` as a float if it is a number (an int or a float, not a bool or a list)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ReplyError(f"{what} is {type(value).__name__} {value!r:.40}, not a number")
    return float(value)


def count(value, what: str, known: int | None = None, *, least: int = 1) -> int:
    """``value`` as a count: a finite whole number of at least ``least`` and, when the
    server knows the client's size (``known``), at most that."""
    x = number(value, what)
    if not math.isfinite(x) or x != int(x) or x < least:
        shown = int(x) if math.isfinite(x) and x == int(x) else x
        raise ReplyError(f"{what} is {shown}, not a whole number >= {least}")
    if known is not None and x > known:
        raise ReplyError(f"{what} is {int(x)}, more than the {known} its node gave at the roll call")
    return int(x)


def metrics(record, known: frozenset[str], what: str) -> dict[str, float]:
    """A metric record's figures, each a number, every name one of ``known``."""
    out = {}
    for name, value in dict(record).items():
        if name not in known:
            raise ReplyError(f"{what}: unknown metric {name!r:.60}")
        out[name] = number(value, f"{what} {name!r}")
    return out


def _records(reply: Message, required: dict[str, str], optional: dict[str, str], what: str) -> None:
    """``reply`` holds every ``required`` record and no record besides the ``optional``
    ones, each of its kind (``array``, ``metric`` or ``config``)."""
    content = reply.content
    kinds = {
        **{n: "array" for n in content.array_records},
        **{n: "metric" for n in content.metric_records},
        **{n: "config" for n in content.config_records},
    }
    for name in required:
        if name not in kinds:
            raise ReplyError(f"{what}: record {name!r} is missing")
    for name, kind in kinds.items():
        want = required.get(name) or optional.get(name)
        if want is None:
            raise ReplyError(f"{what}: unexpected record {name!r:.60}")
        if kind != want:
            raise ReplyError(f"{what}: record {name!r} is a {kind} record, not a {want} record")


# ---------------------------------------------------------------- roll call


@dataclass(frozen=True)
class RollCall:
    """A node's answer to the roll call: the client it holds and what it says of it."""

    cid: int
    joined: bool
    num_examples: int
    last_round: int


def read_roll_call(reply: Message) -> RollCall:
    """The roll-call reply's ``node`` record, every field present and of its type."""
    _records(reply, {"node": "config"}, {}, "roll-call reply")
    info = dict(reply.content["node"])
    for key in ("cid", "joined", "num_examples", "last_round"):
        if key not in info:
            raise ReplyError(f"roll-call reply: field {key!r} is missing")
    whole = {k: info[k] for k in ("cid", "num_examples", "last_round")}
    for key, value in whole.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ReplyError(f"roll-call reply: {key} is {value!r:.40}, not a whole number >= 0")
    if not isinstance(info["joined"], bool):
        raise ReplyError(f"roll-call reply: joined is {info['joined']!r:.40}, not a bool")
    return RollCall(info["cid"], info["joined"], info["num_examples"], info["last_round"])


# ---------------------------------------------------------------- training


def uplink_bound(like: Tensors, cfg: CodecConfig) -> int:
    """The most bytes a client's encoded update can take when it should decode into
    ``like`` under ``cfg`` (``comm.uplink``): each tensor's values at the codec's size
    (as it is: its own dtype's, at least float32's, which FedKD's factors travel in; fp16
    or bf16: 2; int8: 1 and a float32 absmax a block; nf4: a half and an absmax a block;
    topk: a float32 value and an int32 position per kept value; randk: the values), and
    each tensor's metadata for up to three parts (a method may send a matrix as factors)."""
    total = 1024
    for t in like.values():
        n = t.numel()
        kept = min(n, math.ceil(cfg.fraction * n) + 1)
        if cfg.codec == "none" or not t.is_floating_point():
            size = max(t.element_size(), 4) * n
        elif cfg.codec in ("fp16", "bf16"):
            size = 2 * n
        elif cfg.codec == "int8":
            size = n + 4 * math.ceil(n / cfg.block)
        elif cfg.codec == "nf4":
            size = math.ceil(n / 2) + 4 * math.ceil(n / cfg.block)
        elif cfg.codec == "topk":
            size = 8 * kept
        else:  # randk
            size = 4 * kept
        total += size + 3 * (4 * 17 + 8)  # up to three parts, each with a #meta (dtype code, 16 dims)
    return total


def uplink_parts(like: Tensors) -> int:
    """The most tensors an encoded update of ``like`` can hold: per tensor up to three
    factors, each in up to three parts (``#meta``, values, positions or scales)."""
    return 9 * len(like) + 8


def check_claims(claims: dict[str, tuple[torch.dtype, tuple[int, ...]]], like: Tensors, what: str) -> None:
    """The dtypes and shapes an update claims (``{name: (dtype, shape)}``: its index, its
    codec's ``#meta``) against ``like``, before anything of their size is allocated: a
    tensor ``like`` names has its dtype, its number of dimensions and no dimension larger
    (a client of a smaller rank sends smaller ones); and all together hold no more values
    than ``like`` (a method may send a matrix as smaller factors, under other names)."""
    budget = sum(t.numel() for t in like.values())
    total = 0
    for name, (dtype, shape) in claims.items():
        ref = like.get(name)
        if ref is not None and (
            dtype != ref.dtype
            or len(shape) != ref.dim()
            or any(a > b for a, b in zip(shape, ref.shape, strict=True))
        ):
            raise ReplyError(
                f"{what}: tensor {name!r} claims {dtype} {shape}, expected {ref.dtype} {tuple(ref.shape)}"
            )
        total += math.prod(shape)
        if total > budget:
            raise ReplyError(
                f"{what}: its tensors claim {total} values or more (tensor {name!r:.60}: {shape}), "
                f"the expected update has {budget}"
            )


def read_uplink(record, like: Tensors, cfg: CodecConfig, what: str) -> Tensors:
    """A client's encoded update from its record, copied only once its bytes fit what an
    update of ``like`` can take under ``cfg`` (:func:`uplink_bound`), and returned only
    once what it claims to decode into fits ``like`` (:func:`check_claims`: the index's
    shapes, before the copy, under ``codec none``; the codec's ``#meta``, before the
    caller decodes it with ``compress.receive_update``)."""
    if not isinstance(record, ArrayRecord):
        raise ReplyError(f"{what}: not a tensor record")
    bound, parts = uplink_bound(like, cfg), uplink_parts(like)
    if compress.lossless(cfg):  # the record holds the tensors themselves
        check_claims(describe(record, bound, parts), like, what)
    message = from_record(record, bound, parts)
    try:
        check_claims(compress.claimed(message), like, what)
    except compress.CompressionError as err:
        raise ReplyError(f"{what}: {err}") from None
    return message


@dataclass
class Fit:
    """A training reply, checked: the client's claimed size (at most what the server
    knows), its time, whether its update fitted within the clip bound (adaptive
    clipping's report), its other metrics, its encoded update (within the expected
    update's size and shapes), its control update (SCAFFOLD; within the expected size)
    and its readout."""

    num_examples: int
    time_fit: float
    fitted: bool
    metrics: dict[str, float]
    message: Tensors
    control: Tensors = field(default_factory=dict)
    readout: dict[str, float] = field(default_factory=dict)


def read_fit(
    reply: Message, *, known: int, like: Tensors, uplink: CodecConfig, control_like: Tensors | None = None
) -> Fit:
    """A training reply, every part checked (see the module's docstring): ``known``: the
    client's training examples as its node said at the roll call; ``like``: the update the
    server expects; ``uplink``: ``comm.uplink``; ``control_like``: SCAFFOLD's control the
    server sent (None: the run has none)."""
    required = {"uplink": "array", "fit": "metric", **({"control": "array"} if control_like else {})}
    _records(reply, required, {"readout": "metric"}, "training reply")
    fit = metrics(reply.content["fit"], FIT_METRICS, "fit metrics")
    for key in ("num_examples", "time_fit"):
        if key not in fit:
            raise ReplyError(f"fit metrics: {key!r} is missing")
    num_examples = count(fit.pop("num_examples"), "num_examples", known)
    time_fit = fit.pop("time_fit")
    if not (math.isfinite(time_fit) and time_fit >= 0):
        raise ReplyError(f"fit metrics: time_fit is {time_fit!r}, not a duration")
    fitted = fit.pop("fitted", 1.0)
    if fitted not in (0.0, 1.0):
        raise ReplyError(f"fit metrics: fitted is {fitted!r}, not 0 or 1")
    readout = metrics(reply.content["readout"], READOUTS, "readout") if "readout" in reply.content else {}
    message = read_uplink(reply.content["uplink"], like, uplink, "update")
    control = {}
    if control_like:
        size = sum(t.numel() * t.element_size() for t in control_like.values())
        control = from_record(reply.content["control"], size, len(control_like))
    return Fit(num_examples, time_fit, bool(fitted), fit, message, control, readout)


def cap_results(fits: list[FitResult], weighting: str, share: float) -> dict[str, float]:
    """Under ``server.weighting: examples``, each result's weight (its ``num_examples``,
    already no more than its node gave at the roll call) capped at ``share`` of the round
    (``deploy.max_weight_share``, :func:`capped_weights`), in place; returns the weights
    the cap lowered, by client id (the round records them)."""
    if weighting != "examples" or share >= 1:
        return {}
    lowered = {}
    for r, w in zip(fits, capped_weights([r.num_examples for r in fits], share), strict=True):
        if w < r.num_examples:
            lowered[str(r.cid)], r.num_examples = w, w
    return lowered


def capped_weights(weights: list[float], share: float) -> list[float]:
    """Each weight capped so that none is more than ``share`` of the capped total: the
    largest weights lowered to one cap ``c = share * sum(min(w, c))`` (the others keep
    theirs), so one client, whatever it claims, moves the mean by at most ``share`` of its
    distance from the others'. ``share`` 1: the weights as they are. When no cap can hold
    every weight to ``share`` (``share * n <= 1``), every weight is the smallest one."""
    n = len(weights)
    if share >= 1 or n == 0:
        return [float(w) for w in weights]
    order = sorted(float(w) for w in weights)
    for k in range(n):  # k: how many of the largest are capped
        if share * k >= 1:
            break
        rest = sum(order[: n - k])
        cap = share * rest / (1 - share * k)
        fits_under = order[n - k - 1] <= cap * (1 + 1e-12)
        capped_above = k == 0 or cap <= order[n - k] * (1 + 1e-12)
        if fits_under and capped_above:
            return [min(float(w), cap) for w in weights]
    return [order[0]] * n


# ---------------------------------------------------------------- evaluation


def score_names(task: str) -> frozenset[str]:
    """The scores the task's scorer gives (:mod:`fedpeft.metrics.scorers`), read off the
    functions that compute them (on no examples they name their scores without work)."""
    if task == "classification":
        return frozenset(classification_scores(np.empty(0), np.empty(0)))
    if task == "token_classification":
        return frozenset(tagging.SCORES)
    if task == "extractive_qa":
        return frozenset(qa.qa_scores([], []))
    return frozenset({"nll", "perplexity", *generation.HIGHER_IS_BETTER})  # causal_lm


@dataclass
class Evaluation:
    """An evaluation reply, checked: the client's scores on its local test split, on the
    global test set (when asked), and of its other models (``local_<name>``)."""

    local: dict[str, float] | None
    global_: dict[str, float] | None
    extra: dict[str, dict[str, float]]


def read_evaluation(reply: Message, names: frozenset[str]) -> Evaluation:
    """An evaluation reply whose every score record holds exactly the scorer's ``names``."""
    extra_names = [n for n in reply.content.metric_records if n.startswith("local_")]
    for name in extra_names:
        if not EXTRA_NAME.fullmatch(name.removeprefix("local_")):
            raise ReplyError(f"evaluation reply: unexpected record {name!r:.60}")
    optional = {
        "local": "metric",
        "global": "metric",
        "config": "config",
        **dict.fromkeys(extra_names, "metric"),
    }
    _records(reply, {}, optional, "evaluation reply")

    def scores(key: str) -> dict[str, float] | None:
        if key not in reply.content:
            return None
        got = metrics(reply.content[key], names, f"evaluation {key}")
        if missing := sorted(names - set(got)):
            raise ReplyError(f"evaluation {key}: metric {missing[0]!r} is missing")
        return got

    trained = dict(reply.content["config"]).get("trained", False) if "config" in reply.content else False
    if not isinstance(trained, bool):
        raise ReplyError("evaluation reply: config 'trained' is not a bool")
    return Evaluation(scores("local"), scores("global"), {n: scores(n) for n in extra_names})


# ---------------------------------------------------------------- SecAgg+


@dataclass
class SecureRound:
    """What the server expects of one round's SecAgg+ replies: each node's known
    training examples, the update's tensors (names, shapes), whether every weight is 1
    (user-level DP), and the round's nodes."""

    known: dict[int, int]
    like: Tensors
    uniform: bool

    def masked_shapes(self) -> list[tuple[int, ...]]:
        """The masked vector's arrays: the weight, then the tensors by name."""
        return [(1,), *(tuple(self.like[n].shape) for n in sorted(self.like))]


def _list_of(value, kind: type, what: str) -> list:
    if not isinstance(value, list) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
        raise ReplyError(f"SecAgg+ reply: {what} is not a list of {kind.__name__}")
    return value


def check_secure_reply(stage: str, reply: Message, node: int, expect: SecureRound) -> None:
    """A SecAgg+ reply of ``stage`` from ``node``: the fields Flower's workflow reads, of
    their types; the masked vector of the arrays and sizes the update has; the training
    result's size and metrics as a plain reply's."""
    if RECORD_KEY_CONFIGS not in reply.content.config_records:
        raise ReplyError(f"SecAgg+ {stage} reply: record {RECORD_KEY_CONFIGS!r} is missing")
    got = reply.content.config_records[RECORD_KEY_CONFIGS]
    if stage == Stage.SETUP:
        for key in (Key.PUBLIC_KEY_1, Key.PUBLIC_KEY_2):
            if not isinstance(got.get(key), bytes):
                raise ReplyError(f"SecAgg+ setup reply: {key} is not bytes")
    elif stage == Stage.SHARE_KEYS:
        destinations = _list_of(got.get(Key.DESTINATION_LIST), int, Key.DESTINATION_LIST)
        if len(_list_of(got.get(Key.CIPHERTEXT_LIST), bytes, Key.CIPHERTEXT_LIST)) != len(destinations):
            raise ReplyError("SecAgg+ share-keys reply: as many ciphertexts as destinations expected")
    elif stage == Stage.COLLECT_MASKED_VECTORS:
        _check_masked(got, reply, node, expect)
    elif stage == Stage.UNMASK:
        nodes = _list_of(got.get(Key.NODE_ID_LIST), int, Key.NODE_ID_LIST)
        if unknown := sorted(set(nodes) - set(expect.known)):
            raise ReplyError(f"SecAgg+ unmask reply: shares of node {unknown[0]}, not of this round")
        if len(_list_of(got.get(Key.SHARE_LIST), bytes, Key.SHARE_LIST)) != len(nodes):
            raise ReplyError("SecAgg+ unmask reply: as many shares as nodes expected")


def _check_masked(got, reply: Message, node: int, expect: SecureRound) -> None:
    import flwr.compat.common.recorddict_compat as compat

    vectors = _list_of(got.get(Key.MASKED_PARAMETERS), bytes, Key.MASKED_PARAMETERS)
    shapes = expect.masked_shapes()
    if len(vectors) != len(shapes):
        raise ReplyError(f"SecAgg+ masked vector: {len(vectors)} arrays, expected {len(shapes)}")
    for k, (data, shape) in enumerate(zip(vectors, shapes, strict=True)):
        if len(data) > 8 * math.prod(shape) + 1024:
            raise ReplyError(f"SecAgg+ masked vector: array {k} is {len(data)} bytes, for {shape} values")
        dtype, declared, _ = npy_layout(data, f"masked vector {k}")
        if dtype.kind not in "iu" or declared != shape:
            raise ReplyError(
                f"SecAgg+ masked vector: array {k} is {dtype} {declared}, expected integers {shape}"
            )
    try:
        fitres = compat.recorddict_to_fitres(reply.content, keep_input=True)
    except (KeyError, TypeError, ValueError) as err:
        raise ReplyError(f"SecAgg+ training result: {type(err).__name__} {err}") from None
    known = expect.known[node]
    if expect.uniform and fitres.num_examples != 1:
        raise ReplyError(f"SecAgg+ weight is {fitres.num_examples!r}, user-level DP weighs every client 1")
    count(fitres.num_examples, "num_examples", known)
    figures = metrics(fitres.metrics, SECURE_METRICS, "fit metrics")
    if "time_fit" not in figures or not (math.isfinite(figures["time_fit"]) and figures["time_fit"] >= 0):
        raise ReplyError("fit metrics: time_fit is missing or not a duration")
    if "num_examples" in figures:
        count(figures["num_examples"], "num_examples", known)
