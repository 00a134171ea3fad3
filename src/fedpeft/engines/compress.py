"""Compressed messages (issue 34): the codecs a message's tensors cross the network in.

``comm.uplink`` and ``comm.downlink`` each name a codec (:class:`~fedpeft.config.CodecConfig`):

    none    the tensors as they are
    fp16    each value rounded to half precision (relative error <= 2^-11 in fp16's normal range)
    bf16    each value rounded to bfloat16 (relative error <= 2^-8)
    int8    blockwise absmax 8-bit (bitsandbytes' ``quantize_blockwise``, its dynamic code):
            one byte a value, one float32 absmax a block of ``block`` values; error <= the
            block's absmax times half the widest gap between neighbouring codes
    nf4     4-bit NormalFloat (Dettmers et al. 2023; bitsandbytes' ``quantize_4bit``): two
            values a byte, one float32 absmax a block; the same bound with NF4's 16 codes
    topk    the ``fraction`` of values largest in magnitude (at least one a tensor), float32,
            with their int32 positions
    randk   a ``fraction`` of the values at positions drawn from a seed both ends know (the
            run's seed, the round, the client): the values alone cross

An encoded message is plain tensors, and its bytes are what a run records as sent:

    <name>          codec none, and any tensor that is not floating point: as it is
    <name>#meta     int32 [dtype code, *shape]: what the receiver decodes into
    <name>#values   fp16 / bf16 values; topk and randk: the kept values
    <name>#index    topk: the kept values' int32 flat positions
    <name>#codes    int8: a uint8 code a value; nf4: two 4-bit codes a byte
    <name>#absmax   int8, nf4: float32, one a block

The uplink sends an **update**: for each tensor the client received (same name and shape)
the difference from what it received, which the server adds back to what it sent; any
other tensor is sent as its values. With error feedback (``error_feedback``; on by
default for topk and randk, Stich et al. 2018, Karimireddy et al. 2019) the client adds
what compression left out of its last update (the residual, personal state kept in the
client store) before encoding, and keeps what is left out this time: sent + new residual
= update + old residual. The downlink sends values (a client that missed rounds holds no
reference a delta could rest on), so it takes the quantisers only. Encoding happens on
the sender, decoding where the real system decodes: the server decodes uplinks before
aggregating, a client its downlink before training. With codec ``none`` nothing is
touched: a run is bit for bit the uncompressed one.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from fedpeft.config import CodecConfig
from fedpeft.engines.local import derive_seed
from fedpeft.methods.base import Tensors

SEP = "#"
RESIDUAL = "comm.residual."  # a client's error-feedback residual in its personal state
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SPARSIFIERS = ("topk", "randk")


class CompressionError(ValueError):
    """A tensor a codec cannot carry (named)."""


#: randk's stream beside a client's round seed: both ends draw the same positions from it
RANDK_STREAM = 0x52414E4B


def message_seed(round_seed: int) -> int:
    """The seed of a client's uplink message in a round (``round_seed``: the engine's
    ``(seed, round, client)`` seed of that client's round)."""
    return derive_seed(round_seed, RANDK_STREAM)


def lossless(cfg: CodecConfig) -> bool:
    return cfg.codec == "none"


def error_feedback(cfg: CodecConfig) -> bool:
    """Whether the sender carries what compression left out into its next message."""
    if lossless(cfg):
        return False
    return cfg.codec in SPARSIFIERS if cfg.error_feedback is None else cfg.error_feedback


# ---------------------------------------------------------------- one tensor


def _bitsandbytes():
    """bitsandbytes' quantisers, imported on first use (the import takes seconds)."""
    import bitsandbytes.functional

    return bitsandbytes.functional


def _meta(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([DTYPES.index(dtype), *x.shape], dtype=torch.int32)


def _kept(numel: int, fraction: float) -> int:
    return max(1, min(numel, round(fraction * numel)))


def random_positions(numel: int, fraction: float, seed: int, name: str) -> torch.Tensor:
    """randk's positions of tensor ``name``: drawn from ``seed`` and the name, sorted."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return torch.randperm(numel, generator=generator)[: _kept(numel, fraction)].sort().values


def encode_tensor(
    name: str, x: torch.Tensor, cfg: CodecConfig, seed: int = 0, dtype: torch.dtype | None = None
) -> Tensors:
    """Tensor ``x`` (called ``name``) as the parts ``cfg``'s codec sends; the receiver
    decodes it into ``dtype`` (default ``x``'s)."""
    if lossless(cfg) or not x.is_floating_point() or x.numel() == 0:
        return {name: x}
    dtype = dtype or x.dtype
    if dtype not in DTYPES or x.dtype not in DTYPES:
        raise CompressionError(f"{name}: comm codec {cfg.codec} carries {DTYPES}, not {x.dtype}")
    flat, part = x.detach().reshape(-1), lambda what: f"{name}{SEP}{what}"
    out = {part("meta"): _meta(x, dtype)}
    if cfg.codec in ("fp16", "bf16"):
        dtype = torch.float16 if cfg.codec == "fp16" else torch.bfloat16
        if cfg.codec == "fp16" and (big := flat.abs().max().item() if flat.numel() else 0.0) > 65504:
            raise CompressionError(
                f"{name}: a value of magnitude {big:.4g} exceeds fp16's largest (65504); use bf16 or int8"
            )
        out[part("values")] = flat.to(dtype)
    elif cfg.codec == "int8":
        bnb = _bitsandbytes()
        codes, state = bnb.quantize_blockwise(flat.float(), blocksize=cfg.block)
        out[part("codes")], out[part("absmax")] = codes, state.absmax.float()
    elif cfg.codec == "nf4":
        bnb = _bitsandbytes()
        codes, state = bnb.quantize_4bit(flat.float(), blocksize=cfg.block, quant_type="nf4")
        out[part("codes")], out[part("absmax")] = codes.reshape(-1), state.absmax.float()
    elif cfg.codec == "topk":
        index = flat.abs().topk(_kept(flat.numel(), cfg.fraction)).indices.sort().values
        out[part("values")], out[part("index")] = flat[index].float(), index.to(torch.int32)
    else:  # randk
        out[part("values")] = flat[random_positions(flat.numel(), cfg.fraction, seed, name)].float()
    return out


def decode_tensor(name: str, parts: Tensors, cfg: CodecConfig, seed: int = 0) -> torch.Tensor:
    """The tensor ``name`` from its encoded ``parts`` (as :func:`encode_tensor` made them)."""
    if name in parts:
        return parts[name]
    meta = parts[f"{name}{SEP}meta"].tolist()
    dtype, shape = DTYPES[meta[0]], tuple(meta[1:])
    numel = int(torch.Size(shape).numel())
    get = lambda what: parts[f"{name}{SEP}{what}"]  # noqa: E731
    if cfg.codec in ("fp16", "bf16"):
        flat = get("values")
    elif cfg.codec == "int8":
        flat = _bitsandbytes().dequantize_blockwise(get("codes"), absmax=get("absmax"), blocksize=cfg.block)
    elif cfg.codec == "nf4":
        bnb = _bitsandbytes()
        state = bnb.QuantState(
            absmax=get("absmax"),
            shape=torch.Size([numel]),
            code=bnb.get_4bit_type("nf4", device="cpu"),
            blocksize=cfg.block,
            quant_type="nf4",
            dtype=torch.float32,
        )
        flat = bnb.dequantize_4bit(get("codes").reshape(-1, 1), state)
    else:
        index = (
            get("index").long() if cfg.codec == "topk" else random_positions(numel, cfg.fraction, seed, name)
        )
        flat = torch.zeros(numel, dtype=torch.float32).index_put_((index,), get("values"))
    return flat.reshape(shape).to(dtype)


def claimed(message: Tensors) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """What each tensor of an encoded ``message`` decodes into, its dtype and shape, read
    from its ``#meta`` alone (a tensor sent as it is: its own). A receiver checks these
    against what it expects before :func:`decode` allocates them (topk and randk decode
    into a dense tensor of the claimed shape). :class:`CompressionError` naming the tensor
    when a ``#meta`` is missing or is not an int32 vector of a dtype code and a shape."""
    out = {}
    for name in names_in(message):
        if name in message:
            out[name] = (message[name].dtype, tuple(message[name].shape))
            continue
        meta = message.get(f"{name}{SEP}meta")
        if meta is None or meta.dtype != torch.int32 or meta.dim() != 1 or not 1 <= len(meta) <= 17:
            got = "none" if meta is None else f"{meta.dtype} {tuple(meta.shape)}"
            raise CompressionError(f"{name}: its {SEP}meta is {got}, not int32 [dtype code, *shape]")
        code, *shape = meta.tolist()
        if not 0 <= code < len(DTYPES) or any(size < 0 for size in shape):
            raise CompressionError(f"{name}: its {SEP}meta {[code, *shape]} is no dtype code and shape")
        out[name] = (DTYPES[code], tuple(shape))
    return out


# ---------------------------------------------------------------- messages


def encode(tensors: Tensors, cfg: CodecConfig, seed: int = 0) -> Tensors:
    """A message's tensors as they cross the wire."""
    if lossless(cfg):
        return tensors
    return {k: v for name, x in tensors.items() for k, v in encode_tensor(name, x, cfg, seed).items()}


def names_in(message: Tensors) -> list[str]:
    """The tensors an encoded message carries, in order."""
    return list(dict.fromkeys(key.split(SEP, 1)[0] for key in message))


def decode(message: Tensors, cfg: CodecConfig, seed: int = 0) -> Tensors:
    """The tensors an encoded message carries."""
    if lossless(cfg):
        return message
    return {name: decode_tensor(name, message, cfg, seed) for name in names_in(message)}


def _has_reference(name: str, x: torch.Tensor, reference: Tensors) -> bool:
    ref = reference.get(name)
    return ref is not None and x.is_floating_point() and ref.shape == x.shape


@dataclass
class Sent:
    """A client's compressed update: the message on the wire and the residual it keeps."""

    message: Tensors
    residual: Tensors


def send_update(uplink: Tensors, reference: Tensors, residual: Tensors, cfg: CodecConfig, seed: int) -> Sent:
    """The client's side: ``uplink`` as the update from ``reference`` (what it received),
    plus the carried ``residual``, encoded; with error feedback, the new residual."""
    if lossless(cfg):
        return Sent(uplink, {})
    quantity, message = {}, {}  # quantity: what is encoded, in float32
    for name, x in uplink.items():
        if x.is_floating_point():
            value = x.float() - reference[name].float() if _has_reference(name, x, reference) else x.float()
            carried = residual.get(name)  # none, or one of another shape (a rank cut): start afresh
            quantity[name] = (
                value + carried.float() if carried is not None and carried.shape == value.shape else value
            )
        message.update(encode_tensor(name, quantity.get(name, x), cfg, seed, dtype=x.dtype))
    if not error_feedback(cfg):
        return Sent(message, {})
    decoded = decode(message, cfg, seed)
    return Sent(message, {n: q - decoded[n].float() for n, q in quantity.items()})


def receive_update(message: Tensors, reference: Tensors, cfg: CodecConfig, seed: int) -> Tensors:
    """The server's side: the client's uplink, decoded and added back to ``reference``
    (what the server sent it) where it is an update."""
    if lossless(cfg):
        return message
    out = {}
    for name, x in decode(message, cfg, seed).items():
        out[name] = (
            (reference[name].float() + x.float()).to(reference[name].dtype)
            if _has_reference(name, x, reference)
            else x
        )
    return out


def residual_of(personal: Tensors) -> tuple[Tensors, Tensors]:
    """A stored personal state split into the method's part and the error-feedback residual."""
    own = {k: v for k, v in personal.items() if not k.startswith(RESIDUAL)}
    residual = {k[len(RESIDUAL) :]: v for k, v in personal.items() if k.startswith(RESIDUAL)}
    return own, residual


def with_residual(personal: Tensors, residual: Tensors) -> Tensors:
    """The personal state to store: the method's part and the residual, prefixed."""
    return {**personal, **{RESIDUAL + k: v for k, v in residual.items()}}
