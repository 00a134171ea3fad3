"""bitsandbytes, imported only by the features that use it.

peft imports bitsandbytes whenever it can find it: at ``import peft``, and each time it
puts LoRA on a model (to offer its quantised LoRA layers). The import takes a second and,
on a CPU, logs a warning about kernels it cannot fetch ("Failed to load CPU
gemm_4bit_forward from kernels-community"). fedpeft uses bitsandbytes for a quantised
backbone (``model.quantization``) and for int8 / NF4 messages (``comm.uplink``,
``comm.downlink``), so work on a config that uses neither runs inside
:func:`bitsandbytes_unless`, where bitsandbytes cannot be imported, and peft and
transformers see it as not installed. Outside, it is there again: the availability checks
those libraries cache are cleared on the way in and out, so a later config in the same
process that quantises finds it.

The mechanism is Python's own: ``sys.modules[name] = None`` makes ``import name`` raise
``ModuleNotFoundError`` and ``importlib.util.find_spec(name)`` return None.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedpeft.config import ExperimentConfig

BITSANDBYTES = "bitsandbytes"
#: the codecs of ``comm.uplink`` / ``comm.downlink`` that bitsandbytes computes
BITSANDBYTES_CODECS = {"int8", "nf4"}
#: ``module -> functions`` that cache whether bitsandbytes is installed (``functools.lru_cache``)
CACHED_CHECKS = {
    "peft.import_utils": ("is_bnb_available", "is_bnb_4bit_available"),
    "transformers.utils.import_utils": ("is_bitsandbytes_available",),
}


def uses_bitsandbytes(cfg: ExperimentConfig) -> bool:
    """Whether ``cfg`` quantises its backbone or its messages with bitsandbytes."""
    codecs = {cfg.comm.uplink.codec, cfg.comm.downlink.codec}
    return cfg.model.quantization != "none" or bool(codecs & BITSANDBYTES_CODECS)


@contextmanager
def bitsandbytes_unless(needed: bool) -> Iterator[None]:
    """bitsandbytes out of reach within the block, unless ``needed`` (or already imported:
    then there is nothing left to spare). Blocks nest."""
    if needed or BITSANDBYTES in sys.modules:
        yield
        return
    sys.modules[BITSANDBYTES] = None
    _forget_cached_checks()
    try:
        yield
    finally:
        if BITSANDBYTES in sys.modules and sys.modules[BITSANDBYTES] is None:
            del sys.modules[BITSANDBYTES]
        _forget_cached_checks()


def _forget_cached_checks() -> None:
    for module_name, functions in CACHED_CHECKS.items():
        module = sys.modules.get(module_name)
        for name in functions:
            check = getattr(module, name, None)
            if hasattr(check, "cache_clear"):
                check.cache_clear()
