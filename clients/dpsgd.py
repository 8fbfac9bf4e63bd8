"""DP-SGD client (the ALI-DPFL paper's Algorithms 2 and 3; docs/algorithms.md §5).

Sample-level DP: each local step draws a Poisson batch with rate q_s, clips every
per-sample gradient to C, adds N(0, sigma^2 C^2 I) to the sum and divides by the
expected batch size q_s |D_i| (the optimizer's `loss_reduction="mean"`; the paper divides
by the realised |B_t|, which is itself data-dependent). The per-sample gradients come from
the summed loss (`loss_reduction="sum"` in the GradSampleModule): the same gradients the
mean loss gives after Opacus multiplies them back by |B_t|, without that multiplication
(7-15% of a step on the MNIST CNN). The Opacus pieces are the ones
`PrivacyEngine.make_private` wires together (GradSampleModule, DPOptimizer, Poisson
sampler, ghost-clipping loss); they are wired here directly because `make_private`
derives q from the data loader's length (1/ceil(N/batch)) instead of taking q_s.

The client's sample-level privacy ledger (its (sigma, q_s, steps) events) lives in
Flower's `Context.state`, so it survives rounds although the client object does not.
The client never takes a step that would push its epsilon above the target.

DP-SGD-WAV (the wavelet paper's Algorithm 1, `noise = "wavelet"`; docs/algorithms.md §6): per-sample clipping
on the norm of the Haar coefficients and Haar-wavelet noise (`HaarDPOptimizer`); its
true noise multiplier is sigma_H / n (derivation: `coefficient_clipping_noise_multiplier`).
"""

from __future__ import annotations

import json
import math
import secrets
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import ConfigRecord, RecordDict
from torch import nn

from dpfl.dpcore.task.opacus_import import import_opacus

import_opacus()  # first: Opacus' own import would give the root logger a handler (dpcore/task/opacus_import.py)
from opacus.grad_sample.utils import prepare_module  # noqa: E402
from opacus.optimizers import DPOptimizer, get_optimizer_class  # noqa: E402
from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping  # noqa: E402
from opacus.utils.uniform_sampler import UniformWithReplacementSampler  # noqa: E402

from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.privacy.accountants import DEFAULT_ACCOUNTANT, epsilon_of
from dpfl.dpcore.privacy.dpsgd_noise import dpsgd_multipliers
from dpfl.dpcore.privacy.ledger import PrivacyLedger
from dpfl.dpcore.privacy.mechanisms import (
    flatten,
    gaussian_noise,
    haar_coefficient_norms,
    haar_wavelet_noise,
    l2_norm,
    make_rng,
    unflatten,
)
from dpfl.dpcore.privacy.settings import check_delta, check_dpsgd_clipping
from dpfl.dpcore.task.device import model_device
from dpfl.dpcore.task.torch_helpers import as_tensors, get_weights, loss_gradient, opacus_compatible, set_weights

from .base import TrainingClient

LEDGER_KEY = "dpsgd-ledger"


def torch_generator(
    seed: int, *stream: int, secure: bool = False, device: torch.device | str = "cpu"
) -> torch.Generator:
    """A torch generator on `device` (Opacus draws the DP-SGD noise where the gradients are: on a CUDA
    device, from a CUDA generator), seeded from (seed, *stream), or, when `secure`, with 63 bits of OS
    entropy (`secrets`) drawn anew for every generator, never from the run seed."""
    value = secrets.randbits(63) if secure else int(make_rng(seed, *stream).integers(2**63))
    return torch.Generator(device=device).manual_seed(value)


class HaarDPOptimizer(DPOptimizer):
    """DP-SGD-WAV's optimizer (the wavelet paper's Algorithm 1 on Opacus' DPOptimizer).

    Each per-sample gradient is clipped on the norm of its paper-normalised Haar
    coefficients (||H||_2 <= C, `max_grad_norm`), which scales the whole gradient by
    min(1, C / ||H||); the sum gets the paper's wavelet noise (std sigma_H C / W per
    coefficient, `haar_wavelet_noise` on all parameters as one vector). Its true noise
    multiplier is `coefficient_clipping_noise_multiplier(sigma_H, n)` = sigma_H / n.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        wavelet_noise_multiplier: float,
        noise_rng: np.random.Generator,
        **kwargs,
    ) -> None:
        super().__init__(optimizer, noise_multiplier=wavelet_noise_multiplier, **kwargs)
        self.noise_rng = noise_rng

    def clip_and_accumulate(self) -> None:
        """sum_s min(1, C / ||H(g_s)||) g_s into p.summed_grad (public Opacus API only: `grad_samples`; no
        gradient is used twice, since `dpsgd_steps` zeroes them before every step and its module forbids
        accumulation)."""
        grad_samples = self.grad_samples
        samples = torch.cat([g.flatten(1) for g in grad_samples], dim=1)  # (batch, d)
        norms = torch.from_numpy(haar_coefficient_norms(samples.detach().cpu().numpy())).to(samples.device)
        factors = (self.max_grad_norm / (norms + 1e-12)).clamp(max=1.0).to(samples.dtype)
        for p, grad_sample in zip(self.params, grad_samples):
            grad = torch.einsum("i,i...", factors.to(p.dtype), grad_sample.to(p.dtype))
            p.summed_grad = grad if p.summed_grad is None else p.summed_grad + grad

    def add_noise(self) -> None:
        """p.grad = summed_grad + the paper's wavelet noise, over all parameters as one vector (numpy noise,
        drawn on the CPU)."""
        summed = torch.cat([p.summed_grad.reshape(-1) for p in self.params]).detach()
        noisy = torch.from_numpy(
            haar_wavelet_noise(summed.cpu().numpy(), self.noise_multiplier * self.max_grad_norm, self.noise_rng)
        ).to(summed.device)
        for p, part in zip(self.params, torch.split(noisy, [p.numel() for p in self.params])):
            p.grad = part.reshape(p.shape).to(p.dtype)


def dpsgd_steps(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    steps: int,
    sample_rate: float,
    noise_multiplier: float,
    clipping_norm: float,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    grad_sample_mode: str = "ew",
    sampling_generator: torch.Generator | None = None,
    noise_generator: torch.Generator | None = None,
    secure_mode: bool = False,
    noise: str = "gaussian",
    wavelet_rng: np.random.Generator | None = None,
) -> int:
    """Run `steps` DP-SGD steps on (x, y) in place; returns the number of noisy steps taken.

    Per step: batch B ~ Poisson(q) over the data; g = (sum_{s in B} clip_C(grad l(w; s))
    + N(0, sigma^2 C^2 I)) / (q |D|); SGD (momentum, weight decay) steps with g. Empty
    batches still take a noise-only step, as the sampled Gaussian mechanism requires.
    `noise = "wavelet"`: DP-SGD-WAV (`HaarDPOptimizer`; `noise_multiplier` is sigma_H,
    `wavelet_rng` draws its noise). Steps are counted by Opacus' optimizer step hook, the
    hook its own accountants use. (x, y) stay where they are; each batch moves to the model's device,
    where `noise_generator` must be.
    """
    check_dpsgd_clipping(grad_sample_mode, noise)
    ghost = grad_sample_mode == "ghost"
    if steps <= 0:
        return 0
    extra = {"max_grad_norm": clipping_norm} if ghost else {}
    reduction = "mean" if ghost else "sum"  # per-sample gradients of l(w; s): see the module docstring
    device = model_device(model)
    gsm = prepare_module(model, grad_sample_mode, True, batch_first=True, loss_reduction=reduction, **extra)
    gsm.forbid_grad_accumulation()
    params = [p for p in gsm.parameters() if p.requires_grad]
    sgd = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    common = dict(max_grad_norm=clipping_norm, expected_batch_size=sample_rate * len(y), loss_reduction="mean")
    if noise == "wavelet":
        optimizer = HaarDPOptimizer(
            sgd, wavelet_noise_multiplier=noise_multiplier, noise_rng=wavelet_rng or np.random.default_rng(), **common
        )
    else:
        optimizer = get_optimizer_class("flat", False, grad_sample_mode)(
            sgd, noise_multiplier=noise_multiplier, generator=noise_generator, secure_mode=secure_mode, **common
        )
    taken = 0

    def count(_optimizer) -> None:
        nonlocal taken
        taken += 1

    optimizer.attach_step_hook(count)
    criterion = (
        DPLossFastGradientClipping(gsm, optimizer, nn.CrossEntropyLoss(), "mean")
        if ghost
        else nn.CrossEntropyLoss(reduction="sum")
    )
    sampler = UniformWithReplacementSampler(
        num_samples=len(y), sample_rate=sample_rate, generator=sampling_generator, steps=steps
    )
    gsm.train()
    try:
        with warnings.catch_warnings():  # torch warns that the inputs do not require grad: harmless here
            warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
            for indices in sampler:
                optimizer.zero_grad()
                if indices or ghost:  # ghost clipping handles empty batches itself
                    idx = torch.as_tensor(indices, dtype=torch.long)
                    criterion(gsm(x[idx].to(device)), y[idx].to(device)).backward()
                else:  # no sample: the sum of clipped gradients is zero, only noise remains
                    for p in params:
                        p.grad_sample = p.new_zeros((0, *p.shape))
                optimizer.step()
    finally:
        gsm._close()  # remove hooks and per-sample attributes: `model` is a plain module again
    return taken


def strong_convexity_ratio(
    model: nn.Module, dataset, global_weights: list[np.ndarray], local_weights: list[np.ndarray], max_samples: int = 0
) -> float:
    """||grad F(w_i) - grad F(w)|| / ||w_i - w|| on `dataset` (ALI-DPFL's mu term; nan when w_i = w)."""
    distance = l2_norm(flatten(local_weights) - flatten(global_weights))
    if distance == 0:
        return math.nan
    set_weights(model, global_weights)
    g_global = loss_gradient(model, dataset, max_samples)
    set_weights(model, local_weights)
    g_local = loss_gradient(model, dataset, max_samples)
    return l2_norm(g_local - g_global) / distance


def load_ledger(state: RecordDict, delta: float, accountant: str) -> tuple[PrivacyLedger, dict]:
    """(sample-level ledger, counts {"steps", "mu-releases"}) from Context.state; fresh in the first round."""
    if LEDGER_KEY in state:
        record = state[LEDGER_KEY]
        counts = {"steps": int(record["steps"]), "mu-releases": int(record["mu-releases"])}
        return PrivacyLedger.from_state_dict(json.loads(record["ledger"])), counts
    return PrivacyLedger(delta, accountant), {"steps": 0, "mu-releases": 0}


def save_ledger(state: RecordDict, ledger: PrivacyLedger, counts: dict) -> None:
    state[LEDGER_KEY] = ConfigRecord(
        {
            "ledger": json.dumps(ledger.state_dict()),
            "steps": int(counts["steps"]),
            "mu-releases": int(counts["mu-releases"]),
        }
    )


@dataclass
class DPSGDRound:
    """One round of a DP-SGD client before its steps: what `DPSGDClient.fit` and the cohort engine
    (clients/cohort/dpsgd.py) both train from, and charge with `finish_round`."""

    rnd: int
    ledger: PrivacyLedger
    counts: dict
    release_mu: bool
    steps: int  # allowed by the budget
    lr: float
    sampling_generator: torch.Generator  # Poisson masks: torch.rand(|D|) < q per step (Opacus' sampler)
    noise_generator: torch.Generator  # Gaussian noise, on the client's device (Opacus' DPOptimizer)
    wavelet_rng: np.random.Generator  # DP-SGD-WAV's noise (HaarDPOptimizer)


class DPSGDClient(TrainingClient):
    """ALI-DPFL client: `local-steps` (from the server) DP-SGD steps, within its own epsilon budget.

    Parameters beyond TrainingClient's: state (Context.state), sample_rate q_s,
    noise_multiplier sigma, clipping_norm C (per sample), grad_sample_mode (Opacus),
    target_epsilon and delta of the sample-level guarantee, mu_max and
    mu_noise_multiplier of the mu release that the server may ask for (`release-mu`
    in the train config; ALI-DPFL with mu-source = clients), noise ("gaussian" or
    "wavelet": DP-SGD-WAV) and wavelet_calibration ("paper" or "exact"). delta >= 1/n (n: its samples) is refused
    unless allow_large_delta (`dpcore.privacy.settings.check_delta`).

    Reported metrics: local-steps (taken this round), dpsgd-steps and mu-releases
    (cumulative), epsilon (its ledger after this round), epsilon-claimed (DP-SGD-WAV
    with `paper` calibration: what the paper's analysis would print), budget-left (1 if
    a round of one step still fits), mu (noisy, when asked), partition-id, update-norm,
    num-examples. No training loss: it is computed on private batches and would be an
    unaccounted release.
    """

    def __init__(
        self,
        model: nn.Module,
        trainset,
        testset,
        *,
        state: RecordDict,
        sample_rate: float,
        noise_multiplier: float,
        clipping_norm: float,
        target_epsilon: float,
        delta: float,
        accountant: str = DEFAULT_ACCOUNTANT,
        grad_sample_mode: str = "ew",
        mu_max: float = 1.0,
        mu_noise_multiplier: float = 10.0,
        noise: str = "gaussian",
        wavelet_calibration: str = "exact",
        num_partitions: int = 1,
        allow_large_delta: bool = False,
        **kwargs,
    ) -> None:
        kwargs["channels_last"] = False  # Opacus' ew per-sample gradients fail on channels_last convolutions
        super().__init__(opacus_compatible(model), trainset, testset, **kwargs)
        if mu_max <= 0 or mu_noise_multiplier <= 0:
            raise ValueError(f"mu_max={mu_max!r} and mu_noise_multiplier={mu_noise_multiplier!r} must be > 0")
        if not 0 < sample_rate <= 1 or noise_multiplier <= 0 or clipping_norm <= 0 or target_epsilon <= 0:
            raise ValueError(
                f"DP-SGD needs 0 < sample_rate <= 1 (got {sample_rate}), noise_multiplier > 0 "
                f"(got {noise_multiplier}), clipping_norm > 0 (got {clipping_norm}) and "
                f"target_epsilon > 0 (got {target_epsilon})"
            )
        check_delta(delta, len(self.trainset), allow_large_delta, "samples of this client")  # sample-level: 1/n
        self.state, self.sample_rate, self.num_partitions = state, sample_rate, num_partitions
        self.noise_multiplier, self.clipping_norm = noise_multiplier, clipping_norm
        self.target_epsilon, self.delta, self.accountant = target_epsilon, delta, accountant
        self.grad_sample_mode, self.noise = grad_sample_mode, noise
        self.mu_max, self.mu_noise_multiplier = mu_max, mu_noise_multiplier
        dim = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self.mechanism_multiplier, self.accounted_multiplier, self.budget_multiplier = dpsgd_multipliers(
            noise_multiplier, noise, wavelet_calibration, dim
        )

    # -- budget ---------------------------------------------------------------
    def budget_events(self, counts: dict, steps: int = 0, release_mu: bool = False) -> list:
        """The events the step budget is checked on: all steps and mu releases so far, plus a round.

        Equal to the ledger's events, except for DP-SGD-WAV with `paper` calibration, whose
        budget follows the paper's claim (sigma_H) so that the published mechanism runs.
        """
        return [
            (self.budget_multiplier, self.sample_rate, counts["steps"] + steps),
            (self.mu_noise_multiplier, 1.0, counts["mu-releases"] + int(release_mu)),
        ]

    def fits(self, counts: dict, steps: int, release_mu: bool) -> bool:
        return (
            epsilon_of(self.budget_events(counts, steps, release_mu), self.delta, self.accountant)
            <= self.target_epsilon
        )

    def allowed_steps(self, counts: dict, requested: int, release_mu: bool = False) -> int:
        """Largest n <= requested whose round keeps epsilon <= target (R_c minus steps already taken)."""
        if requested <= 0 or not self.fits(counts, 1, release_mu):
            return 0
        if self.fits(counts, requested, release_mu):
            return requested
        lo, hi = 1, requested  # fits(lo) and not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.fits(counts, mid, release_mu) else (lo, mid)
        return lo

    # -- Flower API -----------------------------------------------------------
    def train(self, config: dict) -> tuple[float, int]:
        raise NotImplementedError("DPSGDClient trains in fit() (its step count depends on the budget)")

    def fit(self, parameters: list[np.ndarray], config: dict):
        plan = self.plan_round(config)
        set_weights(self.model, parameters)
        x, y = as_tensors(self.trainset)
        taken = dpsgd_steps(
            self.model,
            x,
            y,
            steps=plan.steps,
            sample_rate=self.sample_rate,
            noise_multiplier=self.mechanism_multiplier,
            clipping_norm=self.clipping_norm,
            lr=plan.lr,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            grad_sample_mode=self.grad_sample_mode,
            sampling_generator=plan.sampling_generator,
            noise_generator=plan.noise_generator,
            secure_mode=self.secure_rng,
            noise=self.noise,
            wavelet_rng=plan.wavelet_rng,
        )
        return self.finish_round(parameters, get_weights(self.model), taken, plan)

    def plan_round(self, config: dict) -> DPSGDRound:
        """The round's ledger, its allowed steps, learning rate and generators (before any step; writes nothing)."""
        rnd = int(config.get(keys.SERVER_ROUND, 0))
        ledger, counts = load_ledger(self.state, self.delta, self.accountant)
        self.adopt_server_counts(ledger, counts, config)
        release_mu = bool(config.get(keys.RELEASE_MU, False))
        stream, secure = (rnd, self.partition_id), self.secure_rng
        return DPSGDRound(
            rnd,
            ledger,
            counts,
            release_mu,
            self.allowed_steps(counts, int(config.get(keys.LOCAL_STEPS, 1)), release_mu),
            float(config.get(keys.LEARNING_RATE, self.lr)),
            torch_generator(self.seed, 6, *stream, secure=secure),
            torch_generator(self.seed, 5, *stream, secure=secure, device=self.device),
            make_rng(self.seed, 5, *stream, secure=secure),
        )

    def finish_round(self, parameters: list[np.ndarray], new: list[np.ndarray], taken: int, plan: DPSGDRound):
        """fit's reply from the trained weights `new` after `taken` noisy steps: the ledger charged and saved to
        Context.state, the mu release where asked, the metrics."""
        ledger, counts, release_mu = plan.ledger, plan.counts, plan.release_mu
        metrics = {
            keys.PARTITION_ID: self.partition_id,
            keys.NUM_PARTITIONS: self.num_partitions,
            keys.LOCAL_STEPS: taken,
        }
        if taken > 0:
            ledger.record(self.accounted_multiplier, self.sample_rate, taken)
            counts["steps"] += taken
            if release_mu:
                metrics[keys.MU] = self.release_mu(parameters, new, plan.rnd)
                ledger.record(self.mu_noise_multiplier, 1.0, 1)
                counts["mu-releases"] += 1
        save_ledger(self.state, ledger, counts)
        if self.budget_multiplier != self.accounted_multiplier:
            metrics[keys.EPSILON_CLAIMED] = epsilon_of(self.budget_events(counts), self.delta, self.accountant)
        update = flatten(new) - flatten(parameters)
        n = len(self.trainset)
        metrics.update(
            {
                keys.DPSGD_STEPS: counts["steps"],
                keys.MU_RELEASES: counts["mu-releases"],
                keys.EPSILON: ledger.epsilon(),
                keys.BUDGET_LEFT: int(self.fits(counts, 1, release_mu)),
                keys.UPDATE_NORM: l2_norm(update),
                keys.NUM_EXAMPLES: n,
                keys.UPLOAD_KIND: keys.UPLOAD_UPDATE,
            }
        )
        return unflatten(update, [a.shape for a in new]), n, metrics

    def adopt_server_counts(self, ledger: PrivacyLedger, counts: dict, config: dict) -> None:
        """Charge what the server has charged this client beyond its own counts (its state was lost)."""
        for key, count, multiplier, rate in (
            (keys.SPENT_STEPS, "steps", self.accounted_multiplier, self.sample_rate),
            (keys.SPENT_MU_RELEASES, "mu-releases", self.mu_noise_multiplier, 1.0),
        ):
            server = int(config.get(key, 0))
            if server > counts[count]:
                ledger.record(multiplier, rate, server - counts[count])
                counts[count] = server

    def release_mu(self, global_weights: list[np.ndarray], local_weights: list[np.ndarray], rnd: int) -> float:
        """clip(||grad F_i(w_i) - grad F_i(w)|| / ||w_i - w||, 0, mu_max) + N(0, (z mu_max)^2).

        The clipped ratio lies in [0, mu_max], so one sample changes it by at most mu_max:
        a Gaussian mechanism with noise multiplier z on the full local data (q = 1).
        """
        ratio = strong_convexity_ratio(self.model, self.trainset, global_weights, local_weights)
        set_weights(self.model, local_weights)
        clipped = min(max(ratio if math.isfinite(ratio) else 0.0, 0.0), self.mu_max)
        rng = make_rng(self.seed, 7, rnd, self.partition_id, secure=self.secure_rng)
        return clipped + float(gaussian_noise(1, self.mu_noise_multiplier * self.mu_max, rng)[0])
