"""Differential privacy of what leaves a client (issue 34): user-level DP-FedAvg, local DP
and the accounting of sample-level DP-SGD (whose steps are :mod:`fedpeft.engines.local.dp`'s).

The uplink's order (docs/architecture.md, "One round, written once"): the client
clips its update, adds its own noise (``local``), then compresses; the server decodes,
adds its noise (``user``), then the method aggregates and the server optimiser steps.

- ``user`` (McMahan et al. 2018, "Learning Differentially Private Recurrent Language
  Models"): each client clips its update ``u - x`` (all of its uplink's tensors as one
  vector) to L2 norm ``C``; the server estimates the mean update with a fixed
  denominator, ``(sum of clipped updates + N(0, sigma^2 C^2)) / S``, where ``S`` is the
  clients asked per round (public, the same every round, whoever drops out). Uniform
  weights: a weight by examples would let one client's size move the sum.
  With adaptive clipping (Andrew et al. 2021, "Differentially Private Learning with
  Adaptive Clipping") each client also reports whether its update fitted within ``C``;
  the server counts them with noise ``N(0, sigma_b^2)`` and moves ``C`` geometrically
  towards the ``target_quantile``; the two noises together cost as one Gaussian of
  multiplier ``sigma = (sigma_u^-2 + (2 sigma_b)^-2)^-1/2`` (the paper's Theorem 1), so
  the update's own multiplier is ``sigma_u = (sigma^-2 - (2 sigma_b)^-2)^-1/2``.
- ``local``: each client clips as above and adds ``N(0, sigma^2 C^2)`` to its own update
  before it leaves; the server aggregates as usual (weights as ``server.weighting`` says).

Accounting (:class:`Accountant`) is Google's ``dp-accounting`` (RDP), not hand-written.
Clients are drawn without replacement, ``S`` of ``N`` each round, so the neighbouring
relation is replace-one (one client's data replaced), under which a clipped sum moves by
up to ``2C``: the accountant's Gaussian multiplier is ``sigma / 2``. ``user``: each round
is a ``SampledWithoutReplacementDpEvent(N, S, Gaussian(sigma / 2))``; ``local``: a plain
``Gaussian(sigma / 2)`` per round, every round (a client's messages are seen as its own,
so no amplification by sampling is claimed; a client that sits a round out spends less).

- ``sample`` (Abadi et al. 2016): DP-SGD in every local step (``local.dp.private_gradients``);
  each client's records are accounted on their own (:class:`SampleAccountant`): a step of
  a client of ``n`` rows is a ``SampledWithoutReplacementDpEvent(n, B, Gaussian(sigma / 2))``.

Noise is drawn from generators seeded by ``(seed, round)`` (the server's) or the client's
job seed, so a resumed run draws the same noise. With ``sigma = 0`` and a clip no update
reaches, every function here returns its input itself: the run is the non-private one
bit for bit.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from dataclasses import dataclass

import torch

from fedpeft.config import ConfigError, ExperimentConfig, PrivacyConfig, TrainConfig
from fedpeft.engines.local import clip_factor, norm
from fedpeft.methods.base import FitResult, Method, ServerState, Tensors

CLIP = "privacy.clip"  # the server's extras: the adaptive clipping bound of the next round
SIGMA = "privacy.sigma"  # the server's extras (deployed DP-SGD): the noise multiplier, calibrated once
ROWS = "privacy.rows"  # the server's extras (deployed DP-SGD): (client, training rows) of every client known
SERVER_STREAM, CLIENT_STREAM = 0x44505356, 0x44504C43  # "DPSV", "DPLC"


@contextlib.contextmanager
def quiet_orders():
    """dp-accounting warns, through absl's logger, of each Rényi order at which its bound for
    a Poisson-sampled Gaussian does not converge and which it therefore leaves out (a
    calibration at q = 0.2 prints hundreds); leaving an order out can only loosen the
    bound, never understate epsilon, so those warnings are silenced while it computes."""
    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


class PrivacyBudgetExceeded(RuntimeError):
    """A round would spend more than ``privacy.target_epsilon``."""


# ---------------------------------------------------------------- configuration


def noise_multiplier(
    p: PrivacyConfig, population: int, per_round: int, rounds: int, poisson: bool = False
) -> float:
    """``privacy.noise_multiplier``, or the least one that spends ``target_epsilon`` in
    ``rounds`` rounds (at ``delta``), calibrated by ``dp-accounting``."""
    if p.noise_multiplier is not None:
        return p.noise_multiplier
    import dp_accounting

    def accountant(sigma: float) -> Accountant:
        return Accountant(p.mode, population, per_round, sigma, poisson)

    with quiet_orders():
        return dp_accounting.calibrate_dp_mechanism(
            lambda: accountant(1.0).fresh(),
            lambda sigma: accountant(sigma).event(rounds),
            p.target_epsilon,
            p.delta,
            bracket_interval=dp_accounting.LowerEndpointAndGuess(1e-3, 1.0),
            tol=1e-4,
        )


def accountant_for(cfg: ExperimentConfig) -> Accountant | None:
    """User or local mode's accountant (its noise multiplier calibrated if asked), else None;
    a :class:`ConfigError` when the planned rounds would exceed the budget. Both engines and
    every deployed node compute it alike from the config."""
    poisson = cfg.train.client_sampling == "poisson"
    return user_accountant(cfg.privacy, cfg.partition.num_clients, cfg.train.clients_per_round,
                           cfg.train.rounds, poisson)  # fmt: skip


def user_accountant(
    p: PrivacyConfig, clients: int, per_round: int, rounds: int, poisson: bool
) -> Accountant | None:
    """:func:`accountant_for` from its figures: ``clients`` (N), ``per_round`` (S asked, at most N)."""
    if p.mode in ("none", "sample"):  # sample: built from the clients (sample_accountant)
        return None
    s = min(per_round, clients)
    accountant = Accountant(p.mode, clients, s, noise_multiplier(p, clients, s, rounds, poisson), poisson)
    check_plan(p, accountant, rounds)
    return accountant


def _REPLACE_ONE():  # noqa: N802 - dp_accounting's enum member, imported when used
    import dp_accounting

    return dp_accounting.NeighboringRelation.REPLACE_ONE


@dataclass(frozen=True)
class Accountant:
    """The (epsilon, delta) spent after a number of rounds (``dp-accounting``'s RDP)."""

    mode: str
    population: int  # N: the clients drawn from
    per_round: int  # S: drawn each round without replacement (Poisson: on average)
    sigma: float  # the mechanism's noise multiplier (std / C)
    poisson: bool = False  # train.client_sampling: poisson (user mode: add/remove accounting)

    @property
    def add_or_remove(self) -> bool:
        """User mode under Poisson sampling is accounted add/remove-one (a sum moves by C);
        otherwise replace-one (by 2C)."""
        return self.mode == "user" and self.poisson

    def fresh(self):
        """An empty RDP accountant of this mechanism's neighbouring relation."""
        import dp_accounting

        relation = dp_accounting.NeighboringRelation
        return dp_accounting.rdp.RdpAccountant(
            neighboring_relation=relation.ADD_OR_REMOVE_ONE if self.add_or_remove else relation.REPLACE_ONE
        )

    def event(self, rounds: int):
        import dp_accounting

        if self.add_or_remove:  # each client drawn with probability q = S / N
            q = self.per_round / self.population
            poisson = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(self.sigma))
            return dp_accounting.SelfComposedDpEvent(poisson, rounds)
        gaussian = dp_accounting.GaussianDpEvent(self.sigma / 2)  # replace-one: a sum moves by 2C
        if self.mode == "user" and self.per_round < self.population:
            gaussian = dp_accounting.SampledWithoutReplacementDpEvent(
                self.population, self.per_round, gaussian
            )
        return dp_accounting.SelfComposedDpEvent(gaussian, rounds)

    @functools.lru_cache(maxsize=64)  # noqa: B019 - a few hundred rounds of one frozen accountant
    def epsilon(self, rounds: int, delta: float) -> float:
        if rounds == 0:
            return 0.0
        if self.sigma == 0:
            return math.inf
        with quiet_orders():
            return float(self.fresh().compose(self.event(rounds)).get_epsilon(delta))


def check_plan(p: PrivacyConfig, accountant: Accountant, rounds: int) -> None:
    """A :class:`ConfigError` before training when the run's ``rounds`` would spend more
    than ``privacy.target_epsilon``, naming the first round over it."""
    if p.target_epsilon is None:
        return
    over = [r for r in range(1, rounds + 1) if accountant.epsilon(r, p.delta) > p.target_epsilon * (1 + 1e-6)]
    if over:
        raise ConfigError(
            f"privacy.target_epsilon {p.target_epsilon:g}: with privacy.noise_multiplier "
            f"{accountant.sigma:g}, round {over[0]} of train.rounds {rounds} would spend epsilon "
            f"{accountant.epsilon(over[0], p.delta):.3f} (delta {p.delta:g}); lower train.rounds, raise "
            "the noise multiplier, or leave it unset to calibrate it"
        )


def check_budget(p: PrivacyConfig, accountant: Accountant, rnd: int) -> float:
    """The epsilon spent once round ``rnd`` is done; :class:`PrivacyBudgetExceeded` when it
    would exceed ``privacy.target_epsilon`` (checked before the round runs)."""
    spent = accountant.epsilon(rnd, p.delta)
    if p.target_epsilon is not None and spent > p.target_epsilon * (1 + 1e-6):
        before = accountant.epsilon(rnd - 1, p.delta)
        raise PrivacyBudgetExceeded(
            f"privacy: round {rnd} would spend epsilon {spent:.3f} (delta {p.delta:g}), over "
            f"privacy.target_epsilon {p.target_epsilon:g} (after round {rnd - 1}: {before:.3f}); the run "
            "stops here. Lower train.rounds, raise privacy.noise_multiplier, or leave it unset to have it "
            "calibrated to the budget"
        )
    return spent


# ---------------------------------------------------------------- the client's side


def reference(method: Method, received: Tensors, like: Tensors) -> Tensors:
    """What the uplink of a client that received ``received`` is an update of: those
    tensors, and zero for each of the method's messages (:meth:`~fedpeft.methods.base.
    Method.uplink_messages`, shaped as in ``like``), which are clipped whole."""
    zeros = {n: torch.zeros(like[n].shape) for n in method.uplink_messages(received) if n in like}
    return {**received, **zeros}


def update_of(uplink: Tensors, received: Tensors, method: str) -> Tensors:
    """The client's update, ``uplink - received``, tensor by tensor (float32)."""
    out = {}
    for name, x in uplink.items():
        ref = received.get(name)
        if not x.is_floating_point() or ref is None or ref.shape != x.shape:
            raise ConfigError(
                f"privacy.mode: method {method} sends {name!r}, which is not an update of a tensor it "
                "received (another shape, or none); differential privacy clips updates only"
            )
        out[name] = x.float() - ref.float()
    return out


def gaussian(like: Tensors, std: float, seed: int, stream: int) -> Tensors:
    """``N(0, std^2)`` noise shaped as ``like``, drawn on the CPU from ``(seed, stream)``."""
    generator = torch.Generator().manual_seed((seed * 0x9E3779B1 + stream) % 2**63)
    return {
        n: (torch.randn(t.shape, generator=generator, dtype=torch.float64) * std).float()
        for n, t in sorted(like.items())
    }


@dataclass
class Privatised:
    uplink: Tensors  # what leaves the client (before compression)
    fitted: bool  # its update was within the clip bound (adaptive clipping's report)
    norm: float  # its update's norm, before clipping (stays on the client: recorded in simulation only)


def privatise(
    p: PrivacyConfig, uplink: Tensors, received: Tensors, clip: float, sigma: float, seed: int, method: str
) -> Privatised:
    """The client's side: its update clipped to ``clip`` and, in ``local`` mode, noised
    with ``N(0, (sigma clip)^2)``; returned as the tensors it sends (``received`` + update)."""
    update = update_of(uplink, received, method)
    size = norm(update)
    factor = clip_factor(size, clip)
    local = p.mode == "local" and sigma > 0
    if factor == 1.0 and not local:  # nothing to change: the uplink itself
        return Privatised(uplink, True, size)
    if factor < 1.0:
        update = {n: u * factor for n, u in update.items()}
    if local:
        noise = gaussian(update, sigma * clip, seed, CLIENT_STREAM)
        update = {n: u + noise[n] for n, u in update.items()}
    sent = {n: (received[n].float() + u).to(uplink[n].dtype) for n, u in update.items()}
    return Privatised(sent, factor == 1.0, size)


# ---------------------------------------------------------------- the server's side


def update_noise_multiplier(p: PrivacyConfig, sigma: float, per_round: int) -> float:
    """The multiplier of the update's own noise: ``sigma`` itself, or with adaptive clipping
    what is left of it once the count's noise is paid for."""
    if not p.adaptive_clip or sigma == 0:
        return sigma
    sigma_b = count_noise(p, per_round)
    if 2 * sigma_b <= sigma:
        raise ConfigError(
            f"privacy.adaptive_clip: the count's noise (privacy.count_noise {sigma_b:g}) must exceed "
            f"half the noise multiplier {sigma:g} (Andrew et al. 2021, Theorem 1); raise it"
        )
    return (sigma**-2 - (2 * sigma_b) ** -2) ** -0.5


def count_noise(p: PrivacyConfig, per_round: int) -> float:
    """``sigma_b``: the std of the noise on the count within the bound (default ``S / 20``, the paper's)."""
    return p.count_noise if p.count_noise is not None else per_round / 20


def current_clip(p: PrivacyConfig, server: ServerState) -> float:
    """The clip bound of the round ``server`` starts: adaptive clipping's last, or ``privacy.clip``."""
    clip = server.extras.get(CLIP)
    return float(clip) if clip is not None else p.clip


def server_side(
    p: PrivacyConfig,
    results: list[FitResult],
    references: list[Tensors],
    fitted: list[bool],
    clip: float,
    per_round: int,
    sigma: float,
    seed: int,
    count: int | None = None,
) -> tuple[list[FitResult], dict, float | None]:
    """``user`` mode's server: the results restated so that the method's plain mean of them
    (weights 1) is ``x + (sum of updates + N(0, (sigma_u C)^2)) / S``, each update taken
    from ``references`` (what each client received: ``x``); the round's record; and the
    next round's clip bound under adaptive clipping (else None). ``seed``: the round's;
    ``count``: the clients behind the results (SecAgg+ returns one result, their mean).

    Each update is clipped to ``C`` again as decoded (:func:`bounded`): the noise covers a
    sum of updates within ``C``, and a lossy uplink codec (its rounding, error feedback's
    residual) can send more than the client clipped. Within ``C`` it is left as it is."""
    record = {"clip": clip, "clipped": sum(not f for f in fitted)}
    if p.mode != "user":
        return results, record, None
    sigma_u = update_noise_multiplier(p, sigma, per_round)
    noise = gaussian(results[0].uplink, sigma_u * clip, seed, SERVER_STREAM) if sigma_u > 0 else None
    scale = (count or len(results)) / per_round  # 1 unless clients dropped out: the denominator stays S
    restated, reclipped = [], 0
    for r, x in zip(results, references, strict=True):
        uplink, factor = r.uplink, 1.0
        if count is None:  # each update on its own (SecAgg+ hands over their clipped mean only)
            factor = bounded(r.uplink, x, clip)
            reclipped += factor < 1.0
        if scale != 1 or noise is not None or factor < 1.0:
            uplink = {}
            for name, u in r.uplink.items():
                value = x[name].float() + scale * factor * (u.float() - x[name].float())
                uplink[name] = (value + noise[name] / per_round if noise is not None else value).to(u.dtype)
        restated.append(FitResult(uplink, r.personal, 1, r.metrics, r.cid, r.control))
    record["reclipped"] = reclipped
    if not p.adaptive_clip:
        return restated, record, None
    generator = torch.Generator().manual_seed((seed * 0x9E3779B1 + SERVER_STREAM + 1) % 2**63)
    sigma_b = count_noise(p, per_round) if sigma > 0 else 0.0
    # each client counts b - 1/2 (Andrew et al.'s Algorithm 1, as TensorFlow Privacy's quantile
    # query): adding or removing one moves the sum by 1/2, the sensitivity Theorem 1's
    # (2 sigma_b)^-2 assumes under Poisson sampling (replacing one moves it by 1, as a raw count)
    draw = float(torch.randn((), generator=generator, dtype=torch.float64))
    noisy = sum(f - 0.5 for f in fitted) + sigma_b * draw
    share = noisy / per_round + 0.5
    record["fitted_share"] = share
    return restated, record, clip * math.exp(-p.clip_lr * (share - p.target_quantile))


def bounded(uplink: Tensors, received: Tensors, clip: float) -> float:
    """The factor that brings the update ``uplink - received`` within L2 norm ``clip``: 1
    when it is within already (a client's clipped update, sent uncompressed, is, but for
    float32's rounding of ``received + update``)."""
    return clip_factor(norm({n: u.double() - received[n].double() for n, u in uplink.items()}), clip)


def with_clip(server: ServerState, clip: float) -> ServerState:
    """``server`` holding the next round's clip bound in its extras (checkpointed, never sent)."""
    return ServerState(server.tensors, {**server.extras, CLIP: torch.tensor(clip, dtype=torch.float64)})


def summary(p: PrivacyConfig, records: list[dict]) -> dict:
    """What ``summary.json`` says of a run's privacy: its mode and the (epsilon, delta) spent."""
    last = records[-1]["privacy"] if records else {}
    return {
        "mode": p.mode,
        "epsilon": last.get("epsilon", 0.0),
        "delta": p.delta,
        "noise_multiplier": last.get("noise_multiplier", p.noise_multiplier),
        "clip": last.get("clip", p.clip),
    }


# ---------------------------------------------------------------- sample-level DP-SGD

#: the Renyi orders the sample-level accountant evaluates (TensorFlow Privacy's usual list)
ORDERS = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)) + [128, 256, 512])


@functools.lru_cache(maxsize=4096)
def _step_rdp(population: int, batch: int, sigma: float) -> tuple[float, ...]:
    """The RDP, at :data:`ORDERS`, of one DP-SGD step: ``batch`` of ``population`` rows
    drawn without replacement, a Gaussian of multiplier ``sigma / 2`` (replace-one), from
    ``dp-accounting``'s RDP accountant (one composition each, read back).

    At each order, the smaller of the library's bound for the sampled step and its RDP of
    the step without sampling (the Gaussian alone). Both bound the step: a sampled step is
    a mixture over batches, each batch's pair of outputs (neighbouring datasets, the same
    rows drawn) is equal or a Gaussian shifted by at most ``2C``, and the Rényi divergence
    is jointly quasi-convex (van Erven and Harremoës 2014, Theorem 13), so the mixture's is
    at most the Gaussian's. The sampled bound (Wang et al. 2019) is loose as ``batch``
    nears ``population``, where it exceeds the Gaussian's: a client of 17 rows, batches of
    16, would otherwise spend more than one of 16, and the fewest rows would not be the
    worst case that :meth:`SampleAccountant.epsilon` plans for (with the smaller of the two,
    a step's RDP does not grow with the rows: tested)."""
    import dp_accounting

    gaussian = dp_accounting.GaussianDpEvent(sigma / 2)
    events = [gaussian]
    if batch < population:
        events.append(dp_accounting.SampledWithoutReplacementDpEvent(population, batch, gaussian))
    bounds = []
    for event in events:
        accountant = dp_accounting.rdp.RdpAccountant(list(ORDERS), _REPLACE_ONE())
        accountant.compose(event)
        bounds.append(accountant._rdp)  # noqa: SLF001 - linear in the steps: scaled below
    return tuple(float(min(at_order)) for at_order in zip(*bounds, strict=True))


def dp_sgd_epsilon(population: int, batch: int, sigma: float, steps: int, delta: float) -> float:
    """Epsilon after ``steps`` DP-SGD steps of one client (``population`` rows, batches of
    ``batch``): the steps' RDP is ``steps`` times one step's."""
    if steps == 0:
        return 0.0
    if sigma == 0:
        return math.inf
    from dp_accounting.rdp import compute_epsilon

    rdp = [steps * x for x in _step_rdp(population, min(batch, population), sigma)]
    return float(compute_epsilon(list(ORDERS), rdp, delta)[0])


@dataclass(frozen=True)
class SampleAccountant:
    """Sample-level DP-SGD's accountant: each client's records are protected by what its
    own steps spent (its rows, its batches, its steps a round, the rounds it trained in);
    a run reports the most any client spent, and plans for the worst case (a client of
    the fewest rows and the most steps, in every round)."""

    sizes: dict[int, int]  # client -> its training rows
    steps: dict[int, int]  # client -> its local steps a round
    batch: int
    sigma: float
    mode: str = "sample"
    first: dict[int, int] | None = None  # client -> its steps on top in its first round (phases)

    def steps_over(self, c: int, rounds: int) -> int:
        """Client ``c``'s steps over the ``rounds`` rounds it trained in."""
        return rounds * self.steps[c] + ((self.first or {}).get(c, 0) if rounds else 0)

    def spent(self, rounds_in: dict[int, int], delta: float) -> float:
        """The most epsilon any client has spent, ``rounds_in[c]`` rounds trained by client ``c``."""
        return max(
            (
                dp_sgd_epsilon(self.sizes[c], self.batch, self.sigma, self.steps_over(c, k), delta)
                for c, k in rounds_in.items()
            ),
            default=0.0,
        )

    def epsilon(self, rounds: int, delta: float) -> float:
        """The worst case after ``rounds`` rounds: the fewest rows, the most steps, every
        round (a step's RDP does not grow with the rows: :func:`_step_rdp`)."""
        worst = min(self.sizes.values())
        most = max(self.steps_over(c, rounds) for c in self.sizes)
        return dp_sgd_epsilon(worst, self.batch, self.sigma, most, delta)


def dp_sgd_accountant(
    p: PrivacyConfig,
    sizes: dict[int, int],
    method: Method,
    train: TrainConfig,
    rounds: int,
    sigma: float | None = None,
) -> SampleAccountant:
    """DP-SGD's accountant over the clients of ``sizes`` (client -> training rows), each
    taking the steps ``method`` takes on its rows under ``train``, in batches of its
    ``batch_size`` (:meth:`~fedpeft.methods.base.Method.private_steps`): at ``sigma``, or at
    the multiplier :func:`sample_accountant` sets."""
    steps = {cid: method.private_steps(n, train) for cid, n in sizes.items()}
    batch = train.batch_size
    every, first = {c: k for c, (k, _) in steps.items()}, {c: k for c, (_, k) in steps.items()}
    if sigma is None:
        return sample_accountant(p, sizes, every, batch, rounds, first=first)
    return SampleAccountant(sizes, every, batch, sigma, first=first)


def sample_accountant(
    p: PrivacyConfig,
    sizes: dict[int, int],
    steps: dict[int, int],
    batch: int,
    rounds: int,
    first: dict[int, int] | None = None,
):
    """DP-SGD's accountant, its noise multiplier given or calibrated (bisection on the
    worst case) so that no client can spend more than ``target_epsilon`` in ``rounds``
    (``steps``: each client's a round; ``first``: its steps on top in its first round)."""
    sigma = p.noise_multiplier
    if sigma is None:
        worst = lambda s: SampleAccountant(sizes, steps, batch, s, first=first).epsilon(rounds, p.delta)  # noqa: E731
        low, high = 1e-2, 1.0
        while worst(high) > p.target_epsilon:
            low, high = high, high * 2
            if high > 1e4:
                raise ConfigError(
                    f"privacy.target_epsilon {p.target_epsilon:g}: no noise multiplier reaches it"
                )
        while high - low > 1e-3 * high:
            mid = (low + high) / 2
            low, high = (mid, high) if worst(mid) > p.target_epsilon else (low, mid)
        sigma = high
    accountant = SampleAccountant(sizes, steps, batch, sigma, first=first)
    check_plan(p, accountant, rounds)
    return accountant


def known_rows(extras: Tensors) -> dict[int, int]:
    """Deployed DP-SGD: each client's training rows as the server kept them (``ROWS``), so
    that a resumed server still accounts for a client whose node is not back (yet)."""
    if ROWS not in extras:
        return {}
    return {int(c): int(n) for c, n in extras[ROWS].tolist()}


def rows_extra(sizes: dict[int, int]) -> torch.Tensor:
    """``sizes`` (client -> training rows) as the server's ``ROWS`` extra: ``(clients, 2)`` int64."""
    return torch.tensor(sorted(sizes.items()), dtype=torch.int64).reshape(-1, 2)


def check_client_plan(
    p: PrivacyConfig, rows: int, steps: tuple[int, int], batch: int, sigma: float, rounds: int
) -> None:
    """A deployed client's own check before DP-SGD: a :class:`PrivacyBudgetExceeded` when
    the server's ``sigma`` is below the client's own ``privacy.noise_multiplier``, or when
    training in every one of ``rounds`` rounds (``steps``: ``Method.private_steps``) at
    ``sigma`` would spend more than ``privacy.target_epsilon`` of its ``rows`` rows (the
    server calibrates ``sigma`` on the clients it knows; a client it did not know, of fewer
    rows, refuses here rather than spend more). The client trusts no noise it did not agree to."""
    if p.noise_multiplier is not None and sigma < p.noise_multiplier:
        raise PrivacyBudgetExceeded(
            f"privacy.noise_multiplier {p.noise_multiplier:g}: the server asks for DP-SGD at noise "
            f"multiplier {sigma:g}, less than this client's own; it does not train"
        )
    if p.target_epsilon is None:
        return
    worst = dp_sgd_epsilon(rows, batch, sigma, rounds * steps[0] + steps[1], p.delta)
    if worst > p.target_epsilon * (1 + 1e-6):
        raise PrivacyBudgetExceeded(
            f"privacy.target_epsilon {p.target_epsilon:g}: this client's {rows} training rows at noise "
            f"multiplier {sigma:g} would spend epsilon {worst:.3f} (delta {p.delta:g}) over train.rounds "
            f"{rounds}; it does not train (the server calibrated the noise on the clients it knew)"
        )


def sample_record(p: PrivacyConfig, accountant: SampleAccountant, done: list[dict], record: dict) -> dict:
    """A DP-SGD round's ``privacy`` record: the most epsilon any client has spent once the
    round's clients (``record["clients"]``, as asked, whether or not they returned) have
    trained, counting their rounds in ``done`` (the records before it: a resumed run
    counts alike)."""
    rounds_in: dict[int, int] = {}
    for r in [*done, record]:
        for c in r["clients"]:
            rounds_in[int(c)] = rounds_in.get(int(c), 0) + 1
    spent = accountant.spent(rounds_in, p.delta)
    return {"epsilon": spent, "delta": p.delta, "noise_multiplier": accountant.sigma, "clip": p.clip}
