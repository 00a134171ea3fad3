"""What the local engine needs of a method: the hooks its cohort loop calls
(:class:`LocalMethod`) and what a client's round returns (:class:`LocalResult`).

``fedpeft.methods.base.Method`` has them all (each method inherits or overrides them);
the engine names them here, so that it imports no method, not even for its annotations.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    import torch

    from fedpeft.data.task import Draw
    from fedpeft.engines.local.jobs import GradientFn, Job, Start
    from fedpeft.tensors import Tensors


class LocalResult(Protocol):
    """A client's result as the engine completes it (``methods.base.FitResult``): its
    personal state, and SCAFFOLD's control update."""

    personal: Tensors
    control: Tensors


#: the result type a method's ``cohort_finish`` makes (``FitResult``)
R = TypeVar("R", bound=LocalResult)
R_co = TypeVar("R_co", bound=LocalResult, covariant=True)


class LocalMethod(Protocol[R_co]):
    """The hooks of a method the local engine calls (``fedpeft.methods.base.Method``'s
    documents them): a client's round as pure functions, and what the method trains."""

    name: str
    shared_names: list[str]
    personal_names: list[str]
    #: the local step differentiates a gradient (it needs attention with second derivatives)
    higher_order: bool

    def cohort_start(self, model: torch.nn.Module, job: Job) -> Start: ...

    def step_draws(self, job: Job, steps: int, generator: torch.Generator) -> Iterator[tuple[Draw, ...]]: ...

    def step_gradients(self, model: torch.nn.Module) -> GradientFn: ...

    def cohort_finish(self, job: Job, params: Tensors, opt: Tensors, metrics: dict[str, float]) -> R_co: ...

    def optimised_names(self) -> list[str]: ...

    def sgd_rates(self) -> dict[str, float]: ...

    def clip_group(self, name: str) -> str: ...
