"""pytorchexample: A Flower / PyTorch app.

Flower's quickstart-pytorch task, with a local loader (scikit-learn's 8x8 digits, no download) in place of
flwr-datasets' CIFAR-10, and the CNN sized for 8x8 grey images (same layer names)."""

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, Dataset


class Net(nn.Module):
    """Model (simple CNN adapted from 'PyTorch: A 60 Minute Blitz')"""

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


def _split():
    """Every 5th image is the centralized test set; the rest is partitioned IID."""
    test = np.arange(1797) % 5 == 0
    return np.flatnonzero(~test), np.flatnonzero(test)


def load_data(partition_id: int, num_partitions: int, batch_size: int):
    """Load partition digits data."""
    train_indices, _ = _split()
    partition = train_indices[partition_id::num_partitions]
    # Divide data on each node: 80% train, 20% test
    cut = int(0.8 * len(partition))
    trainloader = DataLoader(Digits(partition[:cut]), batch_size=batch_size, shuffle=True)
    testloader = DataLoader(Digits(partition[cut:]), batch_size=batch_size)
    return trainloader, testloader


def load_centralized_dataset():
    """Load test set and return dataloader."""
    _, test_indices = _split()
    return DataLoader(Digits(test_indices), batch_size=128)


def train(net, trainloader, epochs, lr, device):
    """Train the model on the training set."""
    net.to(device)  # move model to GPU if available
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for batch in trainloader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    avg_trainloss = running_loss / (epochs * len(trainloader))
    return avg_trainloss


def test(net, testloader, device):
    """Validate the model on the test set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for batch in testloader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    accuracy = correct / len(testloader.dataset)
    loss = loss / len(testloader)
    return loss, accuracy
