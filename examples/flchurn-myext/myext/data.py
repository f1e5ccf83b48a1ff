"""Recipe: a dataset. A loader returning (x_train, y_train, x_test, y_test), a DatasetDict, or a
FederatedDataset; flchurn offers it seed, num_clients, data_dir and download when it takes them."""

import numpy as np


def blobs(seed: int, n: int = 600, dim: int = 8, classes: int = 3, noise: float = 1.0):
    """Gaussian blobs: class c's points around a random centre; 20% held out for testing."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0.0, 3.0, (classes, dim))
    y = rng.integers(0, classes, n)
    x = (centres[y] + rng.normal(0.0, noise, (n, dim))).astype(np.float32)
    cut = int(0.8 * n)
    return x[:cut], y[:cut], x[cut:], y[cut:]


def blobs_hf(seed: int, n: int = 300):
    """The same blobs as a Hugging Face DatasetDict (columns "x" and "label")."""
    import datasets

    xtr, ytr, xte, yte = blobs(seed, n)
    return datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"x": xtr, "label": ytr}),
        "test": datasets.Dataset.from_dict({"x": xte, "label": yte}),
    })


def blobs_federated(data_dir: str, seed: int, n: int = 300):
    """The same blobs as a flwr-datasets FederatedDataset over parquet files in the run's data-dir
    (flchurn reads its "train" and "test" splits; the partition is the run config's)."""
    from pathlib import Path

    from flwr_datasets import FederatedDataset

    folder = Path(data_dir) / "blobs"
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, data in blobs_hf(seed, n).items():
        files[split] = str(folder / f"{split}.parquet")
        data.to_parquet(files[split])
    return FederatedDataset(dataset="parquet", data_files=files, partitioners={"train": 1}, shuffle=False)
