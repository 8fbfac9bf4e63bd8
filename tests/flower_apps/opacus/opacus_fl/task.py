"""opacus: Training with Sample-Level Differential Privacy using Opacus Privacy Engine.

Flower's opacus task, with a local loader (scikit-learn's 8x8 digits, no download) in place of flwr-datasets'
CIFAR-10, the CNN sized for 8x8 grey images (same layer names), and no progress bars. The client trains
3 epochs at lr 0.2 a round (Flower: 1 at 0.001), enough to learn from 115 digits in 8 rounds."""

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, Dataset


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 6, 3, padding=1)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 2 * 2, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 2 * 2)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class Digits(Dataset):
    """Rows {"img", "label"} as flwr-datasets gives them, normalized to [-1, 1]."""

    def __init__(self, indices):
        images, labels = load_digits(return_X_y=True)
        self.images = torch.tensor((images[indices] / 8.0 - 1.0).reshape(-1, 1, 8, 8), dtype=torch.float32)
        self.labels = torch.tensor(labels[indices])

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"img": self.images[i], "label": self.labels[i]}


def load_data(partition_id: int, num_partitions: int):
    """Load partition digits data (every 5th image is held out as the test set of the whole federation)."""
    train_indices = np.flatnonzero(np.arange(1797) % 5 != 0)
    partition = train_indices[partition_id::num_partitions]
    # Divide data on each node: 80% train, 20% test
    cut = int(0.8 * len(partition))
    train_loader = DataLoader(Digits(partition[:cut]), batch_size=32, shuffle=True)
    test_loader = DataLoader(Digits(partition[cut:]), batch_size=32)
    return train_loader, test_loader


def train(net, train_loader, privacy_engine, optimizer, target_delta, device, epochs=1):
    criterion = torch.nn.CrossEntropyLoss()
    net.to(device)
    net.train()
    for _ in range(epochs):
        for batch in train_loader:
            images = batch["img"]
            labels = batch["label"]
            optimizer.zero_grad()
            criterion(net(images.to(device)), labels.to(device)).backward()
            optimizer.step()

    epsilon = privacy_engine.get_epsilon(delta=target_delta)
    return epsilon


def test(net, test_loader, device):
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for batch in test_loader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    accuracy = correct / len(test_loader.dataset)
    return loss, accuracy
