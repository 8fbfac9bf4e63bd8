"""Personalized clients: partial model sharing (DP2-FedSAM, CENTAUR) and fine-tuning baselines.

DP2-FedSAM (the DP²-FedSAM paper, Algorithm 2; docs/algorithms.md §4). The model is a shared
body phi and a personal head h_i. Per sampled client per round:

1. tau_h SGD steps on h_i with phi frozen (lr eta_h);
2. tau_phi SAM steps on phi with h_i frozen (radius rho, lr eta_phi) -- plain SGD for CENTAUR;
3. Delta_i = phi_new - phi_global, clipped to C plus the noise share N(0, sigma^2 C^2 / m)
   (distributed mode); only phi's update is uploaded.

h_i never leaves the client. It persists across rounds in a `HeadStore`: Flower's
`Context.state` in simulation, or a file in the node's state directory in a deployment,
replaced atomically so that a crash mid-write leaves the previous head intact.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict
from flwr.client import NumPyClient
from torch import nn

from dpfl.dpcore.privacy import protocol as keys
from dpfl.dpcore.privacy.mechanisms import make_rng
from dpfl.dpcore.task.atomic import atomic_write
from dpfl.dpcore.task.torch_helpers import evaluate_model, host_tensor, set_weights

from .base import LocalSGD, TrainingClient, evaluation, sgd_step
from .sam import sam_step

Head = dict[str, np.ndarray]


# ---------------------------------------------------------------- head storage


class HeadStore(Protocol):
    """Where a client's personal head lives between rounds."""

    def load(self) -> Head | None:
        """The stored head (parameter name -> array), or None before the first save."""

    def save(self, head: Head) -> None:
        """Replace the stored head."""


class ContextHeadStore:
    """The head as an ArrayRecord in Flower's `Context.state` (simulation: one Context per node)."""

    def __init__(self, state: RecordDict, key: str = "personal-head") -> None:
        self.state, self.key = state, key

    def load(self) -> Head | None:
        if self.key not in self.state.array_records:
            return None
        return {name: array.numpy() for name, array in self.state.array_records[self.key].items()}

    def save(self, head: Head) -> None:
        self.state[self.key] = ArrayRecord({name: Array(np.ascontiguousarray(a)) for name, a in head.items()})


class FileHeadStore:
    """The head as an .npz file, replaced atomically: temp file in the same folder, fsync, os.replace.

    A crash (or an exception) during a save leaves the previous file as it was.
    """

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)

    def load(self) -> Head | None:
        if not self.path.exists():
            return None
        with np.load(self.path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}

    def save(self, head: Head) -> None:
        atomic_write(self.path, lambda f: np.savez(f, **head))


# ---------------------------------------------------------------- clients


@contextlib.contextmanager
def trainable_only(model: nn.Module, names: Sequence[str]) -> Iterator[None]:
    """Within the block, only the parameters named in `names` require grad."""
    keep = set(names)
    before = {name: p.requires_grad for name, p in model.named_parameters()}
    try:
        for name, p in model.named_parameters():
            p.requires_grad_(name in keep)
        yield
    finally:
        for name, p in model.named_parameters():
            p.requires_grad_(before[name])


class PartialSharingClient(TrainingClient):
    """CENTAUR with client-level DP (DP²-FedSAM paper, Sec. V-A): DP2-FedSAM with SGD on the body.

    Parameters exchanged with the server are the body arrays (state_dict entries not in
    `head_keys`, in state_dict order). The head starts as the model's own (seeded) head and
    is then loaded from / saved to `head_store`. Head work per round: `head_steps` steps if
    > 0, else `head_epochs` passes; lr `head_lr` (decayed like lr). Body work: the base
    client's local-steps / local-epochs with lr.
    """

    def __init__(
        self,
        model: nn.Module,
        trainset,
        testset,
        *,
        head_keys: Sequence[str],
        head_store: HeadStore,
        head_epochs: int = 2,
        head_steps: int = 0,
        head_lr: float = 0.1,
        **kwargs,
    ) -> None:
        super().__init__(model, trainset, testset, **kwargs)
        state = model.state_dict()
        unknown = [k for k in head_keys if k not in state]
        if unknown or not head_keys:
            raise ValueError(
                f"head_keys={list(head_keys)!r} must be a non-empty list of the model's "
                f"state_dict keys (unknown: {unknown})"
            )
        self.head_keys = list(head_keys)
        self.body_keys = [k for k in state if k not in set(self.head_keys)]
        self.head_store = head_store
        self.head_epochs, self.head_steps, self.head_lr = head_epochs, head_steps, head_lr

    # -- body / head in and out ------------------------------------------------
    def body_arrays(self) -> list[np.ndarray]:
        state = self.model.state_dict()
        return [state[k].detach().cpu().numpy().copy() for k in self.body_keys]

    def head_arrays(self) -> Head:
        state = self.model.state_dict()
        return {k: state[k].detach().cpu().numpy().copy() for k in self.head_keys}

    def set_body(self, arrays: list[np.ndarray]) -> None:
        if len(arrays) != len(self.body_keys):
            raise ValueError(f"the shared body has {len(self.body_keys)} tensors, received {len(arrays)} arrays")
        self._load({k: a for k, a in zip(self.body_keys, arrays)})

    def stored_head(self) -> Head | None:
        """The stored head, checked against the model's head (names, shapes); None before the first save."""
        head = self.head_store.load()
        if head is None:
            return None
        if sorted(head) != sorted(self.head_keys):
            raise ValueError(f"the stored head has tensors {sorted(head)}, the model's head is {self.head_keys}")
        self._check_shapes(head)
        return head

    def restore_head(self) -> None:
        """Load the stored head into the model (before the first save: keep the model's initial head)."""
        head = self.stored_head()
        if head is not None:
            self._load(head)

    def _check_shapes(self, arrays: dict[str, np.ndarray]) -> None:
        state = self.model.state_dict()
        for k, a in arrays.items():
            if tuple(a.shape) != tuple(state[k].shape):
                raise ValueError(f"tensor {k!r} has shape {tuple(a.shape)}, the model needs {tuple(state[k].shape)}")

    def _load(self, arrays: dict[str, np.ndarray]) -> None:
        self._check_shapes(arrays)
        self.model.load_state_dict({k: host_tensor(a) for k, a in arrays.items()}, strict=False)

    # -- local training ----------------------------------------------------------
    def num_head_steps(self) -> int:
        if self.head_steps > 0:
            return self.head_steps
        return self.head_epochs * max(1, math.ceil(len(self.trainset) / self.batch_size))

    def head_batches(self, config: dict):
        """(tau_h, the head's minibatches): from the client's own generator (seed, 5, round, partition-id)."""
        steps = self.num_head_steps()
        rng = make_rng(self.seed, 5, int(config.get(keys.SERVER_ROUND, 0)), self.partition_id)
        return steps, self.batches(steps, rng)

    def train_head(self, config: dict) -> tuple[float, int]:
        """tau_h plain SGD steps on the head, body frozen (Algorithm 2, lines 5-8), lr round_lr(eta_h)."""
        steps, batches = self.head_batches(config)
        with trainable_only(self.model, self.head_keys):
            params = [p for p in self.model.parameters() if p.requires_grad]
            optimizer = LocalSGD(
                params, lr=self.round_lr(self.head_lr, config), momentum=self.momentum, weight_decay=self.weight_decay
            )
            self.model.train()
            losses = [sgd_step(self.model, self.loss_fn, x, y, optimizer) for x, y in batches]
        return (float(np.mean(losses)) if losses else math.nan), steps

    def train_body(self, config: dict) -> tuple[float, int]:
        """tau_phi steps of `local_step` (SGD here, SAM in DP2FedSAMClient) on the body, head frozen."""
        with trainable_only(self.model, self.body_keys):
            return self.train(config)

    # -- Flower API -----------------------------------------------------------
    def fit(self, parameters: list[np.ndarray], config: dict):
        """Train head then body; save the head locally; upload the privatized body update only."""
        self.set_body(parameters)
        self.restore_head()
        head_loss, head_steps = self.train_head(config)
        loss, steps = self.train_body(config)
        self.head_store.save(self.head_arrays())
        return self.upload_body(parameters, self.body_arrays(), (loss, steps), (head_loss, head_steps), config)

    def upload_body(self, parameters: list[np.ndarray], new: list[np.ndarray], trained, head_trained, config: dict):
        """fit's reply from the trained body `new` (also the cohort engine's, dpfl_tools.cohort): `upload`'s Delta,
        clipping, noise share and metrics, plus the head's (loss, steps) `head_trained`; the head stays here."""
        arrays, n, metrics = self.upload(parameters, new, *trained, config)
        head_loss, head_steps = head_trained
        return arrays, n, {**metrics, keys.HEAD_LOSS: head_loss, keys.HEAD_STEPS: head_steps}

    def evaluate(self, parameters: list[np.ndarray], config: dict):
        """Accuracy of (global body, own head) on this client's held-out split; the head is not changed."""
        self.set_body(parameters)
        self.restore_head()
        return evaluation(*evaluate_model(self.model, self.testset), len(self.testset))


class DP2FedSAMClient(PartialSharingClient):
    """DP2-FedSAM client: PartialSharingClient whose body steps are SAM steps with radius `rho`."""

    def __init__(self, *args, rho: float = 0.5, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rho = rho

    def local_step(self, x, y, optimizer):
        return sam_step(self.model, self.loss_fn, x, y, optimizer, self.rho)


class FineTuneClient(NumPyClient):
    """DP-FedAvg-FT / DP-FedSAM-FT: trains like `inner`; evaluates after fine-tuning the global model locally.

    Evaluation: load the global model, run `fine_tune_steps` local steps of the inner client's
    optimizer (0: its usual local work), evaluate on the held-out split. The fine-tuned model is
    thrown away; nothing is uploaded but the metrics.
    """

    def __init__(self, inner: TrainingClient, fine_tune_steps: int = 0) -> None:
        self.inner, self.fine_tune_steps = inner, fine_tune_steps

    def fit(self, parameters: list[np.ndarray], config: dict):
        return self.inner.fit(parameters, config)

    def tune_config(self, config: dict) -> dict:
        """The fine-tuning's train config: the evaluate config with `fine_tune_steps` local steps (0: as given)."""
        return {**config, keys.LOCAL_STEPS: self.fine_tune_steps} if self.fine_tune_steps else dict(config)

    def evaluate(self, parameters: list[np.ndarray], config: dict):
        set_weights(self.inner.model, parameters)
        _, steps = self.inner.train(self.tune_config(config))
        loss, acc = evaluate_model(self.inner.model, self.inner.testset)
        return evaluation(loss, acc, len(self.inner.testset), {keys.FINE_TUNE_STEPS: steps})
