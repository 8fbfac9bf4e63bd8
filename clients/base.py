"""Base training client: local SGD, then the update Delta = w_local - w_global.

Under `distributed` noise the client clips Delta to C and adds its noise share
N(0, sigma^2 C^2 / m) before upload (docs/algorithms.md §0); the server sends C and
the share's std in the train config. It always reports ||Delta||_2 before clipping, and marks the
upload as an update (`protocol.UPLOAD_KIND`), which a Flower server strategy would otherwise take for weights.

The model trains on `device` (`dpcore.task.device`; each minibatch is moved there) and, where asked,
in channels_last; the weights and the update are CPU numpy arrays, and the noise share is drawn on the CPU.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from flwr.client import NumPyClient
from torch import nn
from torch.optim.sgd import sgd as functional_sgd

from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.privacy.mechanisms import clip_and_noise, flatten, l2_norm, make_rng, unflatten
from dpfl.dpcore.task.device import place_input, place_model
from dpfl.dpcore.task.torch_helpers import as_tensors, evaluate_model, get_weights, set_weights


class LocalSGD:
    """torch.optim.SGD's update (momentum mu, weight decay lambda, no dampening or Nesterov), bit for bit:
    g <- grad + lambda w; b <- mu b + g (b = g at the first step); w <- w - eta b, through torch's own
    functional `torch.optim.sgd.sgd`. Not a `torch.optim.Optimizer`: constructing the first one in a process
    imports torch._dynamo (about 1.1 s here), which every fresh process running a ClientApp would pay (each
    Ray actor, each `flwr-clientapp` of Flower's default isolation) for a compiler local training never uses.
    Parameters whose grad is None are skipped, as torch.optim.SGD skips them."""

    def __init__(self, params, *, lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        self.params = list(params)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.momentum_buffers: list[torch.Tensor | None] = [None] * len(self.params)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        buffers = [self.momentum_buffers[i] for i in live]
        functional_sgd(
            [self.params[i] for i in live],
            [self.params[i].grad for i in live],
            buffers,
            foreach=False,
            weight_decay=self.weight_decay,
            momentum=self.momentum,
            lr=self.lr,
            dampening=0.0,
            nesterov=False,
            maximize=False,
        )
        for i, buffer in zip(live, buffers):  # created at the first step when momentum > 0
            self.momentum_buffers[i] = buffer


Optimizer = LocalSGD | torch.optim.Optimizer  # local training steps take either (DP-SGD: Opacus' optimizer)


def sgd_step(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, optimizer: Optimizer) -> float:
    """One optimizer step on grad F(w) of the minibatch; returns F(w)."""
    optimizer.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    return float(loss.item())


class TrainingClient(NumPyClient):
    """DP-FedAvg client: K steps of local SGD (momentum, weight decay) per round.

    Local work is `local_steps` steps if > 0, else `local_epochs` passes over the data;
    the train config may override either for a round. Subclasses change `local_step`.
    Learning rates decay per round: eta_t = eta * lr_decay^(t-1) (DP2-FedSAM: 0.99).
    The model is moved to `device` (a torch.device or a name, e.g. "cpu", "cuda:0") and, with
    `channels_last`, its 4-d parameters and the image batches use torch.channels_last.
    """

    def __init__(
        self,
        model: nn.Module,
        trainset,
        testset,
        *,
        batch_size: int = 32,
        lr: float = 0.1,
        momentum: float = 0.5,
        weight_decay: float = 5e-4,
        local_epochs: int = 1,
        local_steps: int = 0,
        partition_id: int = 0,
        seed: int = 0,
        secure_rng: bool = True,
        lr_decay: float = 1.0,
        device: torch.device | str = "cpu",
        channels_last: bool = False,
    ) -> None:
        self.device, self.channels_last = torch.device(device), channels_last
        self.model = place_model(model, self.device, channels_last)
        self.trainset, self.testset = trainset, testset
        self.batch_size, self.lr, self.momentum, self.weight_decay = batch_size, lr, momentum, weight_decay
        self.local_epochs, self.local_steps = local_epochs, local_steps
        self.partition_id, self.seed, self.secure_rng = partition_id, seed, secure_rng
        self.lr_decay = lr_decay
        self.loss_fn = nn.CrossEntropyLoss()

    # -- local training -------------------------------------------------------
    def round_lr(self, lr: float, config: dict) -> float:
        """lr * lr_decay^(t-1) in server round t."""
        return lr * self.lr_decay ** max(0, int(config.get(keys.SERVER_ROUND, 1)) - 1)

    def make_optimizer(self, config: dict) -> Optimizer:
        params = [p for p in self.model.parameters() if p.requires_grad]
        return LocalSGD(
            params,
            lr=self.round_lr(float(config.get(keys.LEARNING_RATE, self.lr)), config),
            momentum=self.momentum,
            weight_decay=self.weight_decay,
        )

    def num_steps(self, config: dict) -> int:
        steps = int(config.get(keys.LOCAL_STEPS, self.local_steps))
        if steps > 0:
            return steps
        epochs = int(config.get(keys.LOCAL_EPOCHS, self.local_epochs))
        return epochs * max(1, math.ceil(len(self.trainset) / self.batch_size))

    def batches(self, steps: int, rng: np.random.Generator):
        """`steps` minibatches on the client's device, reshuffling at every pass over the data."""
        x, y = as_tensors(self.trainset)
        order = np.empty(0, dtype=np.int64)
        for _ in range(steps):
            if order.size < self.batch_size:
                order = np.concatenate([order, rng.permutation(len(y))])
            idx, order = torch.from_numpy(order[: self.batch_size]), order[self.batch_size :]
            yield place_input(x[idx], self.device, self.channels_last), y[idx].to(self.device, non_blocking=True)

    def local_step(self, x: torch.Tensor, y: torch.Tensor, optimizer: Optimizer) -> float:
        """One local step (SGD here, SAM in SAMClient); returns the minibatch loss."""
        return sgd_step(self.model, self.loss_fn, x, y, optimizer)

    def round_batches(self, config: dict):
        """(steps, the round's minibatches): the batch order comes from the client's own generator
        (seed, 4, round, partition-id)."""
        steps = self.num_steps(config)
        rng = make_rng(self.seed, 4, int(config.get(keys.SERVER_ROUND, 0)), self.partition_id)
        return steps, self.batches(steps, rng)

    def train(self, config: dict) -> tuple[float, int]:
        """Run the round's local steps; returns (mean loss, steps)."""
        steps, batches = self.round_batches(config)
        optimizer = self.make_optimizer(config)
        self.model.train()
        losses = [self.local_step(x, y, optimizer) for x, y in batches]
        return (float(np.mean(losses)) if losses else math.nan), steps

    # -- Flower API -----------------------------------------------------------
    def privatize(self, update: np.ndarray, config: dict) -> tuple[np.ndarray, float]:
        """Clip + noise share when the server asks for it; returns (upload, norm before clipping)."""
        if not bool(config.get(keys.PRIVATIZE, False)):
            return update, l2_norm(update)
        rng = make_rng(self.seed, 3, int(config.get(keys.SERVER_ROUND, 0)), self.partition_id, secure=self.secure_rng)
        return clip_and_noise(update, float(config[keys.CLIPPING_NORM]), float(config[keys.NOISE_STD]), rng)

    def fit(self, parameters: list[np.ndarray], config: dict):
        set_weights(self.model, parameters)
        loss, steps = self.train(config)
        return self.upload(parameters, get_weights(self.model), loss, steps, config)

    def upload(self, parameters: list[np.ndarray], new: list[np.ndarray], loss: float, steps: int, config: dict):
        """fit's reply from the trained weights `new`: Delta = new - parameters, privatized, and the metrics
        (also what the cohort engine, dpfl_tools.cohort, replies with after training clients together)."""
        update = flatten(new) - flatten(parameters)
        upload, norm = self.privatize(update, config)
        n = len(self.trainset)
        return (
            unflatten(upload, [a.shape for a in new]),
            n,
            {
                keys.UPDATE_NORM: norm,
                keys.TRAIN_LOSS: loss,
                keys.LOCAL_STEPS: steps,
                keys.NUM_EXAMPLES: n,
                keys.UPLOAD_KIND: keys.UPLOAD_UPDATE,
            },
        )

    def evaluate(self, parameters: list[np.ndarray], config: dict):
        set_weights(self.model, parameters)
        return evaluation(*evaluate_model(self.model, self.testset), len(self.testset))


def evaluation(loss: float, accuracy: float, n: int, extra: dict | None = None) -> tuple[float, int, dict]:
    """NumPyClient.evaluate's result for (mean loss, accuracy) on n held-out samples, plus the `extra` metrics (also
    what the cohort engine, dpfl.clients.cohort.evaluate, replies with)."""
    return loss, n, {keys.ACCURACY: accuracy, keys.LOSS: loss, keys.NUM_EXAMPLES: n, **(extra or {})}
