"""Recipe: a partitioner. Any flwr-datasets Partitioner; flchurn hands it a datasets.Dataset with
columns "label", "idx" and "x" (the features, flattened), so it can split by features too."""

import numpy as np
from flwr_datasets.partitioner import Partitioner


class FeatureSkew(Partitioner):
    """Feature skew: sort the examples by their projection on a random direction and cut the order
    into num_partitions contiguous blocks (clients hold different regions of feature space)."""

    def __init__(self, num_partitions: int, seed: int = 0, jitter: float = 0.0) -> None:
        super().__init__()
        self._n, self._seed, self._jitter = num_partitions, seed, jitter
        self._blocks: list[np.ndarray] | None = None

    @property
    def num_partitions(self) -> int:
        return self._n

    def load_partition(self, partition_id: int):
        if self._blocks is None:
            x = np.asarray(self.dataset.with_format("numpy")["x"], dtype=np.float64)
            rng = np.random.default_rng(self._seed)
            score = x @ rng.normal(size=x.shape[1]) + self._jitter * rng.normal(size=len(x))
            self._blocks = np.array_split(np.argsort(score, kind="stable"), self._n)
        return self.dataset.select(self._blocks[partition_id].tolist())
