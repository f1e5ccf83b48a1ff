"""Tiny on-disk dataset fixtures in the real formats (IDX, CIFAR pickles and npz, SVHN .mat,
CINIC-10 ImageFolder), and the location of the shared offline data."""

from __future__ import annotations

import gzip
import io
import pickle
import struct
from pathlib import Path

import numpy as np

from experiments.presets import default_data_dir

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(default_data_dir())  # $FLCHURN_DATA_DIR or the nearest shared/data (worktrees too)


def write_idx(path: Path, arr: np.ndarray, gz: bool) -> None:
    arr = np.ascontiguousarray(arr, dtype=np.uint8)
    data = bytes([0, 0, 0x08, arr.ndim]) + struct.pack(f">{arr.ndim}i", *arr.shape) + arr.tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data) if gz else data)


def make_idx_set(folder: Path, n_train: int = 20, n_test: int = 10, gz: bool = True,
                 seed: int = 0) -> dict[str, np.ndarray]:
    """The four MNIST-named IDX files with random 28x28 images; returns the arrays."""
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": (np.arange(n_train) % 10).astype(np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": (np.arange(n_test) % 10).astype(np.uint8),
    }
    for name, arr in arrays.items():
        write_idx(folder / (name + (".gz" if gz else "")), arr, gz)
    return arrays


def make_cifar_batches(root: Path, per_batch: int = 4, seed: int = 0) -> dict[str, np.ndarray]:
    """torchvision's cifar-10-batches-py/ with tiny pickled batches (bytes keys, like the real)."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    xs, ys = [], []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        x = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        y = [int(v) for v in rng.integers(0, 10, per_batch)]
        with open(folder / name, "wb") as fh:
            pickle.dump({b"batch_label": name.encode(), b"data": x, b"labels": y}, fh)
        xs.append(x)
        ys.append(y)
    return {"x_train": np.concatenate(xs[:5]).reshape(-1, 3, 32, 32),
            "y_train": np.concatenate(ys[:5]), "x_test": xs[5].reshape(-1, 3, 32, 32),
            "y_test": np.asarray(ys[5])}


def _smooth_images(rng: np.random.Generator, n: int) -> np.ndarray:
    """(n, 32, 32, 3) uint8 images that survive JPEG well (flat colour blocks)."""
    blocks = rng.integers(0, 256, (n, 4, 4, 3), dtype=np.uint8)
    return blocks.repeat(8, axis=1).repeat(8, axis=2)


def make_cifar_npz(root: Path, n_train: int = 12, n_test: int = 6, seed: int = 0) -> dict[str, np.ndarray]:
    """data_dir/cifar10/cifar10-jpeg-q75.npz in the shared format; returns the source pixels."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    arrays: dict[str, np.ndarray] = {}
    for split, n in (("train", n_train), ("test", n_test)):
        imgs = _smooth_images(rng, n)
        blobs = []
        for img in imgs:
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="JPEG", quality=75)
            blobs.append(buf.getvalue())
        arrays[f"{split}_jpeg"] = np.frombuffer(b"".join(blobs), dtype=np.uint8)
        arrays[f"{split}_offsets"] = np.concatenate([[0], np.cumsum([len(b) for b in blobs])]).astype(np.int64)
        arrays[f"{split}_labels"] = (np.arange(n) % 10).astype(np.uint8)
        out[f"x_{split}"] = imgs.transpose(0, 3, 1, 2)
        out[f"y_{split}"] = arrays[f"{split}_labels"]
    (root / "cifar10").mkdir(parents=True)
    np.savez(root / "cifar10" / "cifar10-jpeg-q75.npz", **arrays)
    return out


def make_svhn_mat(root: Path, n_train: int = 7, n_test: int = 5, seed: int = 0) -> dict[str, np.ndarray]:
    """torchvision's SVHN files: X (32, 32, 3, n) uint8, y (n, 1) with labels 1..10."""
    import scipy.io

    rng = np.random.default_rng(seed)
    out = {}
    for split, n in (("train", n_train), ("test", n_test)):
        x = rng.integers(0, 256, (32, 32, 3, n), dtype=np.uint8)
        y = (np.arange(n) % 10 + 1).reshape(n, 1).astype(np.uint8)
        scipy.io.savemat(str(root / f"{split}_32x32.mat"), {"X": x, "y": y})
        out[f"x_{split}"], out[f"y_{split}"] = x, y
    return out


CINIC_CLASSES = ("airplane", "automobile", "bird")


def make_cinic(root: Path, per_class: dict[str, int] | None = None, seed: int = 0) -> None:
    """data_dir/CINIC-10/{train,valid,test}/<class>/*.png with a few random 32x32 PNGs."""
    from PIL import Image

    per_class = per_class or {"train": 2, "valid": 1, "test": 1}
    rng = np.random.default_rng(seed)
    for split, k in per_class.items():
        for cls in CINIC_CLASSES:
            folder = root / "CINIC-10" / split / cls
            folder.mkdir(parents=True)
            for j in range(k):
                img = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                Image.fromarray(img).save(folder / f"{cls}-{j}.png")
