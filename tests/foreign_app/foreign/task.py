"""The foreign app's own model and data: softmax regression on 10 Gaussian blobs in 20 dimensions."""

import numpy as np

DIM, CLASSES = 20, 10


def blobs(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    centers = np.random.default_rng(0).normal(0, 1.5, (CLASSES, DIM)).astype(np.float32)
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, n)
    return (centers[y] + rng.normal(0, 1.0, (n, DIM))).astype(np.float32), y


def initial_weights(classes: int = CLASSES) -> list[np.ndarray]:
    return [np.zeros((DIM, classes), np.float32), np.zeros(classes, np.float32)]


def train(weights: list[np.ndarray], x: np.ndarray, y: np.ndarray, steps: int = 30, lr: float = 0.5):
    w, b = (np.array(a, np.float32) for a in weights)
    onehot = np.eye(w.shape[1], dtype=np.float32)[y % w.shape[1]]
    for _ in range(steps):
        logits = x @ w + b
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        g = (p - onehot) / len(y)
        w -= lr * x.T @ g
        b -= lr * g.sum(0)
    return [w, b]


def accuracy(weights: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    w, b = weights
    return float(np.mean(np.argmax(x @ w + b, 1) == y))
