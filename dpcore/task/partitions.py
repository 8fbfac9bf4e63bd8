"""Partitioning: the training pool split across clients, and the server's validation set held out of it.

`partition_indices` splits the pool with the flwr-datasets partitioners; `load_partition` gives one client its
(train, test) share of the pool. With a `validation_fraction` f > 0 the server holds out f of the pool as its
validation set (`load_validation`, for tuning without the test set) and only the rest is partitioned.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np

from dpfl.dpcore.task.catalogue import ArrayDataset, check_dataset
from dpfl.dpcore.task.data import SPLIT_SEED, load_dataset, source_digest
from dpfl.dpcore.task.data_cache import cached_arrays
from dpfl.dpcore.task.mapped import release_pages

PARTITIONERS = ("iid", "dirichlet", "pathological", "natural")


_MIN_DIRICHLET_PARTITION = 2  # so that every client gets a train and a test sample


def partition_indices(
    labels: np.ndarray,
    num_partitions: int,
    partitioner: str,
    *,
    alpha: float = 0.5,
    classes_per_client: int = 2,
    seed: int = 0,
    writer_ids: np.ndarray | None = None,
) -> list[np.ndarray]:
    """Pool indices of each partition, built by the flwr-datasets partitioners; deterministic for a seed.

    iid: a seeded shuffle cut into equal shards. dirichlet: label proportions ~ Dir(alpha), self-balancing,
    at least 2 samples per partition when the partitioner manages within its 10 tries (else some may be
    empty, with a warning). pathological: `classes_per_client` labels per partition, the first one
    round-robin so that every label is used. natural: one writer per partition, `num_partitions` writers
    drawn with the seed from those in `writer_ids`.
    """
    if partitioner not in PARTITIONERS:
        raise ValueError(f"partitioner={partitioner!r} is not one of: {', '.join(PARTITIONERS)}")
    if num_partitions < 1:
        raise ValueError(f"num_partitions={num_partitions} must be at least 1")
    import datasets as hf_datasets

    columns = {"label": np.asarray(labels), "idx": np.arange(len(labels))}
    if partitioner == "natural":
        if writer_ids is None:
            raise ValueError("partitioner='natural' needs writer_ids (one writer id per label)")
        columns["writer_id"] = np.asarray(writer_ids)
    ds = hf_datasets.Dataset.from_dict(columns).with_format("arrow")  # fast column reads

    from flwr_datasets.partitioner import IidPartitioner, NaturalIdPartitioner, PathologicalPartitioner

    if partitioner == "iid":  # IidPartitioner cuts contiguous shards: shuffle first
        return _partition_all(IidPartitioner(num_partitions), ds.shuffle(seed=seed), range(num_partitions))
    if partitioner == "dirichlet":
        try:
            return _dirichlet(ds, num_partitions, alpha, seed, _MIN_DIRICHLET_PARTITION)
        except ValueError as exc:
            if "max number of attempts" not in str(exc):
                raise
            warnings.warn(
                f"Dirichlet partitioning with alpha={alpha} and {num_partitions} partitions could not "
                f"give every partition {_MIN_DIRICHLET_PARTITION} samples: some partitions may be "
                f"empty (raise dirichlet-alpha or lower the number of partitions)",
                stacklevel=2,
            )
            return _dirichlet(ds, num_partitions, alpha, seed, 0)
    if partitioner == "pathological":
        part = PathologicalPartitioner(
            num_partitions,
            "label",
            num_classes_per_partition=classes_per_client,
            class_assignment_mode="first-deterministic",
            seed=seed,
        )
        return _partition_all(part, ds, range(num_partitions))
    part = NaturalIdPartitioner("writer_id")
    part.dataset = ds
    if num_partitions > part.num_partitions:
        raise ValueError(
            f"num_partitions={num_partitions} is more than the {part.num_partitions} writers "
            f"available to partitioner='natural'"
        )
    chosen = np.random.default_rng(seed).choice(part.num_partitions, size=num_partitions, replace=False)
    return [_pool_indices(part.load_partition(int(i))) for i in chosen]


def _partition_all(part, ds, ids) -> list[np.ndarray]:
    part.dataset = ds
    return [_pool_indices(part.load_partition(i)) for i in ids]


def _pool_indices(partition) -> np.ndarray:
    return np.asarray(partition["idx"], dtype=np.int64)


def _dirichlet(ds, num_partitions: int, alpha: float, seed: int, min_size: int) -> list[np.ndarray]:
    from flwr_datasets.partitioner import DirichletPartitioner

    part = DirichletPartitioner(
        num_partitions, "label", alpha=float(alpha), min_partition_size=min_size, self_balancing=True, seed=seed
    )
    with warnings.catch_warnings():  # it warns at every retry
        warnings.simplefilter("ignore")
        return _partition_all(part, ds, range(num_partitions))


def validation_split(pool_size: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(client pool indices, server validation indices): a fixed shuffle of the training pool whose first
    round(f N) samples the server holds out; clients are never given them."""
    order = np.random.default_rng([SPLIT_SEED, 1]).permutation(pool_size)
    held = int(round(fraction * pool_size))
    return np.sort(order[held:]), np.sort(order[:held])


def load_validation(name: str, data_dir: str = "", fraction: float = 0.0) -> ArrayDataset | None:
    """The server's validation set: `fraction` of the training pool, held out from every client (None if 0)."""
    if fraction <= 0:
        return None
    pool, _ = load_dataset(name, data_dir)
    return pool.subset(validation_split(len(pool), fraction)[1])


@functools.lru_cache(maxsize=16)
def _dataset_partitions(
    name: str,
    data_dir: str,
    num_partitions: int,
    partitioner: str,
    alpha: float,
    classes_per_client: int,
    seed: int,
    validation_fraction: float = 0.0,
) -> tuple[np.ndarray, ...]:
    if partitioner == "natural" and name != "femnist":
        raise ValueError(
            f"partitioner='natural' splits by writer, which only dataset 'femnist' records: "
            f"dataset={name!r} needs one of: iid, dirichlet, pathological"
        )
    pool, _ = load_dataset(name, data_dir)

    def build():  # flwr-datasets partitioners, once per setting; later processes read the cache
        clients = validation_split(len(pool), validation_fraction)[0]  # all of the pool when the fraction is 0
        writers = None if pool.writer_ids is None else pool.writer_ids[clients]
        parts = partition_indices(
            pool.y[clients],
            num_partitions,
            partitioner,
            alpha=alpha,
            classes_per_client=classes_per_client,
            seed=seed,
            writer_ids=writers,
        )
        return {f"p{i}": clients[idx] for i, idx in enumerate(parts)}

    held = f"-v{validation_fraction!r}" if validation_fraction else ""
    key = (
        f"partitions-{source_digest(name, data_dir)}-n{num_partitions}-{partitioner}-a{alpha!r}"
        f"-c{classes_per_client}-s{seed}{held}"
    )

    def valid(arrays):
        parts = [arrays.get(f"p{i}") for i in range(num_partitions)]
        return len(arrays) == num_partitions and all(
            p is not None
            and p.ndim == 1
            and p.dtype.kind == "i"
            and (p.size == 0 or 0 <= p.min() <= p.max() < len(pool))
            for p in parts
        )

    arrays = cached_arrays(key, build, valid)
    return tuple(arrays[f"p{i}"] for i in range(num_partitions))


def load_partition(
    name: str,
    partition_id: int,
    num_partitions: int,
    partitioner: str = "dirichlet",
    *,
    alpha: float = 0.5,
    classes_per_client: int = 2,
    seed: int = 0,
    data_dir: str = "",
    validation_fraction: float = 0.0,
) -> tuple[ArrayDataset, ArrayDataset]:
    """A client's (train, test): its partition shuffled with the seed and split 90/10 (the server's validation
    set, `validation_fraction` of the pool, is never partitioned).

    The test part gets at least one sample when the partition has two or more.
    """
    check_dataset(name)
    if not 0 <= partition_id < num_partitions:
        raise ValueError(
            f"partition_id={partition_id} must be in [0, {num_partitions - 1}] for num_partitions={num_partitions}"
        )
    pool, _ = load_dataset(name, data_dir)
    idx = _dataset_partitions(
        name,
        data_dir,
        num_partitions,
        partitioner,
        float(alpha),
        int(classes_per_client),
        int(seed),
        float(validation_fraction),
    )[partition_id]
    idx = np.random.default_rng([seed, partition_id]).permutation(idx)
    n_test = max(1, len(idx) // 10) if len(idx) >= 2 else 0
    train, test = pool.subset(idx[n_test:]), pool.subset(idx[:n_test])
    release_pages(pool.x)  # copies taken: the pool's pages leave this process (dpcore.task.mapped)
    return train, test
