"""Split a labelled dataset across clients: ``partition(spec, labels, N, seed)`` -> index arrays.

Specs (grammar of :mod:`availability.spec`, ``name:key=value,...``):

* ``iid`` - a seeded shuffle cut into N contiguous, near-equal parts (flwr-datasets
  ``IidPartitioner`` over the shuffled order). Disjoint and covering.
* ``dirichlet:alpha=0.5,min-size=0`` - per class, proportions over the N clients drawn from
  Dir(alpha) (Hsu et al. 2019; flwr-datasets ``DirichletPartitioner``, ``partition_by="label"``,
  ``self_balancing=False``). ``min-size``: every client must get at least this many examples;
  flwr-datasets redraws up to 10 times, then a ValueError says so. With ``min-size=0`` a client
  may be empty. Disjoint and covering.
* ``client-dirichlet:alpha=0.5,min-size=0`` - per CLIENT, class proportions q_i ~ Dir(alpha·1_C),
  as the FedAU/FedAWE official code (github.com/IBM/fedau and mingxiang12/FedAWE,
  ``util/util.py``, ``partition``): class c's examples (shuffled by ``seed`` here, dataset order
  there) are cut among the clients in proportion q_ic / Σ_j q_jc, so client i gets about
  Σ_c n_c q_ic / Σ_j q_jc examples. Sizes stay near len/N (100 clients, Fashion-MNIST, alpha 0.1:
  roughly 400-900, where the per-class ``dirichlet`` gives 4 to 3833). ``min-size``: redraw q
  (up to 100 times) until every client has at least this many examples (the official code has no
  minimum). Disjoint and covering.
* ``shards:per-client=2`` - the FedAvg paper's pathological non-IID split: sort by label, cut into
  ``N * per-client`` equal shards, give every client ``per-client`` random shards (flwr-datasets
  ``ShardPartitioner``). Disjoint; the ``len(labels) mod (N * per-client)`` examples left over by
  equal shards are dropped (none for 60000 examples and 100 or 200 clients x 2 or 3 shards).
* ``clustered:clusters=5,classes-per-cluster=2,samples=200`` - FL-FDMS style: clients
  ``[c*N/K, (c+1)*N/K)`` form cluster c (K must divide N); cluster c owns the classes
  ``sorted_classes[(c*classes-per-cluster + j) mod C]``, j < classes-per-cluster (disjoint sets
  when K*classes-per-cluster <= C); every client gets ``samples`` examples drawn uniformly without
  replacement from what is left of its cluster's classes. Disjoint, not covering.
* ``natural`` - client i gets the examples whose ``groups`` value is the i-th smallest distinct
  group id (``groups`` required, with exactly N distinct ids).

Keys are kebab-case as in every spec (``min_size`` is accepted too). The user's own partitioner:
a ``module:attr`` spec or an entry point (group ``flchurn.partitioners``), any flwr-datasets
``Partitioner``, which sees the features as well as the labels (:mod:`workloads.extensions`);
:func:`flwr_partitioner` turns the project's partitioners into flwr-datasets ones.

All are deterministic in ``seed``; every returned array is int64, sorted order is not promised.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from typing import Any

import numpy as np

from availability.spec import SpecError, parse_spec
from runconfig.extensions import Reference, resolve

from .cache import cache_dir, cache_put
from .extensions import user_partition

PARTITIONERS = ("iid", "dirichlet", "client-dirichlet", "shards", "clustered", "natural")
MAX_REDRAWS = 100  # client-dirichlet draws of q before min_size gives up

_PARAMS: dict[str, dict[str, Any]] = {
    "iid": {},
    "dirichlet": {"alpha": 0.5, "min_size": 0},
    "client-dirichlet": {"alpha": 0.5, "min_size": 0},
    "shards": {"per_client": 2},
    "clustered": {"clusters": 5, "classes_per_cluster": 2, "samples": 200},
    "natural": {},
}


def _params(spec: str) -> tuple[str, dict[str, Any]]:
    parsed = parse_spec(spec)
    if parsed.name not in _PARAMS:
        raise SpecError(f"unknown partitioner {parsed.name!r}; known: {', '.join(PARTITIONERS)}")
    return parsed.name, parsed.take(_PARAMS[parsed.name], what="partitioner")


def _flwr_partition(make: Any, labels: np.ndarray, n: int, seed: int, name: str,
                    params: dict[str, Any]) -> list[np.ndarray]:
    """Run a flwr-datasets partitioner on an in-memory dataset in a seeded order, read 'idx'.

    Cached (:mod:`workloads.cache`), keyed by the labels, the partitioner ``name`` and its parsed
    ``params`` (defaults filled: two spellings of one spec share an entry), ``n``, ``seed`` and the versions
    of flwr-datasets and datasets: importing flwr-datasets costs 3 s (it imports seaborn, scipy and
    pandas), which every node's client worker paid again when it started."""
    from importlib.metadata import version

    key = hashlib.sha256(labels.tobytes() + repr((name, sorted(params.items()), n, seed, version("flwr-datasets"),
                                                  version("datasets"))).encode()).hexdigest()[:24]
    file = cache_dir() / f"partition-{key}.npz"
    try:
        with np.load(file) as cached:
            return [cached[f"p{i}"] for i in range(n)]
    except (OSError, KeyError, ValueError):
        pass  # absent or corrupt: partition again
    parts = _flwr_partition_now(make, labels, n, seed)
    arrays: dict[str, Any] = {f"p{i}": part for i, part in enumerate(parts)}
    cache_put(file, lambda fh: np.savez(fh, **arrays))
    return parts


def _flwr_partition_now(make: Any, labels: np.ndarray, n: int, seed: int) -> list[np.ndarray]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        import datasets

        datasets.disable_progress_bars()
        order = np.random.default_rng(seed).permutation(len(labels))
        ds = datasets.Dataset.from_dict({"label": labels[order], "idx": order.astype(np.int64)})
        part = make()
        part.dataset = ds
        return [np.asarray(part.load_partition(i).with_format("numpy")[:]["idx"], dtype=np.int64)
                for i in range(n)]


def partitioner_reference(spec: str) -> Reference | None:
    """The user's partitioner a spec names (``module:attr`` or an entry point), None for a built-in."""
    return resolve(spec, "partitioner", builtin=lambda name: name in _PARAMS)


def partition(spec: str, labels: np.ndarray, num_partitions: int, seed: int,
              groups: np.ndarray | None = None, features: np.ndarray | None = None) -> list[np.ndarray]:
    """Split example indices among ``num_partitions`` clients; see the module docstring.

    A ``module:attr`` spec or an entry point's name runs the user's partitioner (any
    flwr-datasets ``Partitioner``, see :mod:`workloads.extensions`), which also sees ``features``.
    """
    ref = partitioner_reference(spec)
    if ref is not None:
        return user_partition(ref, np.asarray(labels).reshape(-1).astype(np.int64), int(num_partitions), seed,
                              features=features, groups=groups)
    name, p = _params(spec)
    labels = np.asarray(labels).reshape(-1).astype(np.int64)
    n = int(num_partitions)
    if n < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    if name != "natural" and n > len(labels):
        raise ValueError(f"partitioner '{name}': {n} partitions but only {len(labels)} examples")

    if name == "iid":  # flwr-datasets' IidPartitioner (contiguous shards of the seeded order), without
        # a Dataset per client: 100,000 clients in 0.1 s instead of ~150 s (tests/test_partition.py: equal)
        order = np.random.default_rng(seed).permutation(len(labels)).astype(np.int64)
        return list(np.array_split(order, n))

    if name in ("dirichlet", "client-dirichlet"):
        if not p["alpha"] > 0:
            raise SpecError(f"partitioner '{name}': alpha must be > 0, got {p['alpha']}")
        if p["min_size"] < 0 or p["min_size"] * n > len(labels):
            raise SpecError(f"partitioner '{name}': min_size={p['min_size']} impossible for "
                            f"{len(labels)} examples over {n} clients")
    if name == "client-dirichlet":
        return _client_dirichlet(labels, n, seed, **p)

    if name == "dirichlet":
        def make() -> Any:  # imports flwr-datasets only when the partition is not cached
            from flwr_datasets.partitioner import DirichletPartitioner

            return DirichletPartitioner(num_partitions=n, partition_by="label", alpha=p["alpha"],
                                        min_partition_size=p["min_size"], self_balancing=False,
                                        shuffle=True, seed=seed)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # its per-retry min_size warnings
            try:
                return _flwr_partition(make, labels, n, seed, name, p)
            except ValueError as exc:
                raise ValueError(f"partitioner 'dirichlet': no draw with min_size="
                                 f"{p['min_size']} for alpha={p['alpha']}, {n} clients, "
                                 f"{len(labels)} examples; lower min_size or raise alpha "
                                 f"({exc})") from exc

    if name == "shards":
        k = p["per_client"]
        if k < 1 or n * k > len(labels):
            raise SpecError(f"partitioner 'shards': per_client={k} needs {n * k} shards of at "
                            f"least one example, but there are {len(labels)} examples")
        def make_shards() -> Any:
            from flwr_datasets.partitioner import ShardPartitioner

            return ShardPartitioner(num_partitions=n, partition_by="label",
                                    num_shards_per_partition=k, shuffle=True, seed=seed)

        return _flwr_partition(make_shards, labels, n, seed, name, p)

    if name == "clustered":
        return _clustered(labels, n, seed, **p)

    # natural
    if groups is None:
        raise ValueError("partitioner 'natural' needs groups (a client id per example); "
                         "this dataset has none - use iid/dirichlet/shards/clustered")
    groups = np.asarray(groups).reshape(-1)
    if len(groups) != len(labels):
        raise ValueError(f"partitioner 'natural': {len(groups)} group ids for {len(labels)} labels")
    ids, inverse = np.unique(groups, return_inverse=True)
    if len(ids) != n:
        raise ValueError(f"partitioner 'natural': the data has {len(ids)} natural clients "
                         f"(groups), but num_partitions={n}")
    order = np.argsort(inverse, kind="stable")
    return np.split(order.astype(np.int64), np.cumsum(np.bincount(inverse, minlength=n))[:-1])


def _client_dirichlet(labels: np.ndarray, n: int, seed: int, alpha: float, min_size: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    members = [rng.permutation(np.flatnonzero(labels == c)) for c in classes]
    for _ in range(MAX_REDRAWS):
        q = rng.dirichlet(alpha * np.ones(len(classes)), n)  # (N, C): row i is client i's mix
        cuts = [np.round(len(m) * np.cumsum(q[:, c]) / q[:, c].sum()).astype(np.int64)
                for c, m in enumerate(members)]
        parts = [np.concatenate([m[(cut[i - 1] if i else 0):cut[i]] for m, cut in zip(members, cuts, strict=True)])
                 for i in range(n)]
        if min(len(part) for part in parts) >= min_size:
            return [part.astype(np.int64) for part in parts]
    raise ValueError(f"partitioner 'client-dirichlet': no draw in {MAX_REDRAWS} gave every client "
                     f"min_size={min_size} examples (alpha={alpha}, {n} clients, {len(labels)} "
                     "examples); lower min_size or raise alpha")


def cluster_of(spec: str, num_partitions: int) -> np.ndarray | None:
    """Cluster id of every client for a ``clustered`` spec (contiguous blocks), else None."""
    if partitioner_reference(spec) is not None:
        return None
    name, p = _params(spec)
    if name != "clustered":
        return None
    k = p["clusters"]
    if k < 1 or num_partitions % k:
        raise SpecError(f"partitioner 'clustered': clusters={k} must divide "
                        f"num_partitions={num_partitions}")
    return np.arange(num_partitions) // (num_partitions // k)


def _clustered(labels: np.ndarray, n: int, seed: int, clusters: int, classes_per_cluster: int,
               samples: int) -> list[np.ndarray]:
    spec = f"clustered:clusters={clusters}"
    cid = cluster_of(spec, n)
    assert cid is not None
    classes = np.unique(labels)
    if not 1 <= classes_per_cluster <= len(classes):
        raise SpecError(f"partitioner 'clustered': classes_per_cluster={classes_per_cluster} "
                        f"must be in 1..{len(classes)} (the number of classes present)")
    if samples < 1:
        raise SpecError(f"partitioner 'clustered': samples must be >= 1, got {samples}")
    rng = np.random.default_rng(seed)
    available = np.ones(len(labels), dtype=bool)
    parts = []
    for i in range(n):
        own = classes[(cid[i] * classes_per_cluster + np.arange(classes_per_cluster)) % len(classes)]
        pool = np.flatnonzero(available & np.isin(labels, own))
        if len(pool) < samples:
            raise ValueError(f"partitioner 'clustered': client {i} (cluster {cid[i]}, classes "
                             f"{own.tolist()}) needs {samples} examples, only {len(pool)} left")
        pick = rng.choice(pool, size=samples, replace=False)
        available[pick] = False
        parts.append(pick.astype(np.int64))
    return parts


def label_distributions(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """(N, C) label histogram of every client, rows normalised to sum to 1.

    A client with no examples gets the uniform row 1/C (so rows always sum to 1).
    """
    labels = np.asarray(labels).reshape(-1).astype(np.int64)
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    out = np.full((len(parts), num_classes), 1.0 / num_classes)
    for i, idx in enumerate(parts):
        if len(idx):
            counts = np.bincount(labels[np.asarray(idx, dtype=np.int64)], minlength=num_classes)
            if len(counts) > num_classes:
                raise ValueError(f"label {len(counts) - 1} out of range for {num_classes} classes")
            out[i] = counts / counts.sum()
    return out


def flwr_partitioner(spec: str, num_partitions: int, seed: int = 0) -> Any:
    """One of the project's partitioners as a flwr-datasets ``Partitioner``, for any Flower app:
    ``fds = FederatedDataset(dataset=..., partitioners={"train": flwr_partitioner("client-dirichlet:alpha=0.1", 100)})``.
    It splits the dataset's ``label`` column (and ``groups`` for ``natural``) exactly as
    :func:`partition` does for a run with this ``data-seed``."""
    from flwr_datasets.partitioner import Partitioner

    _params(spec)  # a bad spec fails here, not at the first load_partition

    class SpecPartitioner(Partitioner):
        def __init__(self) -> None:
            super().__init__()
            self._parts: list[np.ndarray] | None = None

        @property
        def num_partitions(self) -> int:
            return int(num_partitions)

        def load_partition(self, partition_id: int) -> Any:
            if self._parts is None:
                table = self.dataset.with_format("numpy")
                groups = table["groups"][:] if "groups" in self.dataset.column_names else None
                self._parts = partition(spec, np.asarray(table["label"][:]), num_partitions, seed, groups=groups)
            return self.dataset.select(self._parts[partition_id].tolist())

    SpecPartitioner.__name__ = SpecPartitioner.__qualname__ = f"flchurn[{spec}]"
    return SpecPartitioner()
