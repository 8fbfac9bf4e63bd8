"""Model and data, as Flower's quickstart-pytorch has them: a small net (with BatchNorm, whose integer
`num_batches_tracked` the DP wrapper must pass through untouched) on scikit-learn's 8x8 digits."""

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 64)
        self.bn = nn.BatchNorm1d(64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def load_data(partition_id: int, num_partitions: int):
    """(train x, train y) of this partition and the shared test set: every 5th image is test data."""
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    test = np.arange(len(y)) % 5 == 0
    train_idx = np.flatnonzero(~test)[partition_id::num_partitions]
    return (x[train_idx], y[train_idx]), (x[test], y[test])


def train(net: Net, data, epochs: int, lr: float) -> float:
    x, y = data
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    net.train()
    loss = torch.tensor(0.0)
    generator = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        for idx in torch.randperm(len(y), generator=generator).split(16):
            if len(idx) < 2:  # BatchNorm needs two samples
                continue
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(net(x[idx]), y[idx])
            loss.backward()
            optimizer.step()
    return float(loss)


def test(net: Net, data) -> tuple[float, float]:
    x, y = data
    net.eval()
    with torch.no_grad():
        logits = net(x)
    return float(nn.functional.cross_entropy(logits, y)), float((logits.argmax(1) == y).float().mean())
