"""Tests of workloads.data: real offline files (skipped when absent), format fixtures, generators."""

from __future__ import annotations

import gzip
import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures_data import (
    CINIC_CLASSES,
    SHARED_DATA,
    make_cifar_batches,
    make_cifar_npz,
    make_cinic,
    make_idx_set,
    make_svhn_mat,
    write_idx,
)

from workloads.data import (
    DATASETS,
    MD5,
    DatasetError,
    TensorData,
    file_md5,
    load_dataset,
    normalise,
    read_idx,
    verify_md5,
)

MNIST_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]


def _need_shared(sub: str) -> Path:
    path = SHARED_DATA / sub
    if not path.exists():
        reason = f"offline data {path} absent (set FLCHURN_DATA_DIR to ../shared/data)"
        print(reason)
        pytest.skip(reason)
    return SHARED_DATA


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Keep the CIFAR decode cache of every test in its own temporary folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


# ----------------------------------------------------------------------------- digits

def test_digits_shapes_split_and_normalisation():
    train, test = load_dataset("digits", seed=0)
    assert isinstance(train, TensorData) and len(train) + len(test) == 1797
    assert len(test) == 360 and train.x.shape == (1437, 1, 8, 8) and test.x.shape == (360, 1, 8, 8)
    assert train.x.dtype == torch.float32 and train.y.dtype == torch.int64
    assert train.num_classes == 10 and train.groups is None
    assert set(train.y.tolist()) == set(range(10)) == set(test.y.tolist())
    assert abs(train.x.mean().item()) < 1e-4 and abs(train.x.std().item() - 1) < 1e-3
    # stratified: every class holds about 20% of its examples in the test split
    frac = test.y.bincount(minlength=10).double() / (train.y.bincount(minlength=10) + test.y.bincount(minlength=10))
    assert ((frac - 0.2).abs() < 0.02).all()


def test_digits_split_is_deterministic_in_seed():
    a, at = load_dataset("digits", seed=3)
    b, _ = load_dataset("digits", seed=3)
    c, _ = load_dataset("digits", seed=4)
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert not torch.equal(a.y, c.y)
    # train and test are disjoint images (digits has a few duplicate images, so compare counts)
    rows = {r.tobytes() for r in a.x.numpy()}
    assert sum(r.tobytes() in rows for r in at.x.numpy()) < 10


# ----------------------------------------------------------------------------- (fashion-)MNIST

@pytest.mark.parametrize("name", ["mnist", "fashion-mnist"])
def test_mnist_like_from_shared_data(name):
    root = _need_shared(name)
    train, test = load_dataset(name, root)
    assert train.x.shape == (60000, 1, 28, 28) and test.x.shape == (10000, 1, 28, 28)
    assert train.num_classes == 10
    counts = train.y.bincount(minlength=10).tolist()
    if name == "mnist":
        assert counts == MNIST_COUNTS
        assert test.y.bincount(minlength=10).tolist()[:2] == [980, 1135]
        assert abs(train.x.mean().item()) < 0.01 and abs(train.x.std().item() - 1) < 0.01
    else:
        assert counts == [6000] * 10 and test.y.bincount().tolist() == [1000] * 10
        assert 0.3 < train.x.mean().item() < 0.7  # MNIST constants applied to Fashion-MNIST
    raw = (train.x * 0.3081 + 0.1307) * 255  # undo the normalisation: whole pixel values
    assert (raw[:100] - raw[:100].round()).abs().max() < 1e-3 and raw.min() > -0.01


def test_mnist_md5_verification():
    root = _need_shared("mnist")
    checked = verify_md5("mnist", root)
    assert sorted(checked.values()) == sorted(MD5["mnist"])
    train, _ = load_dataset("mnist", root, verify=True)
    assert len(train) == 60000


def test_md5_mismatch_is_reported(tmp_path):
    make_idx_set(tmp_path / "mnist")
    gz = tmp_path / "mnist" / "train-labels-idx1-ubyte.gz"
    assert file_md5(gz) == hashlib.md5(gzip.decompress(gz.read_bytes())).hexdigest()
    assert file_md5(gz) != hashlib.md5(gz.read_bytes()).hexdigest()  # content, not the .gz bytes
    with pytest.raises(DatasetError, match="md5"):
        verify_md5("mnist", tmp_path)
    with pytest.raises(DatasetError, match="md5"):
        load_dataset("mnist", tmp_path, verify=True)


@pytest.mark.parametrize("gz", [True, False])
@pytest.mark.parametrize("name,folder", [("mnist", "MNIST/raw"), ("fashion-mnist", "FashionMNIST/raw"),
                                         ("mnist", "mnist")])
def test_idx_layouts(tmp_path, name, folder, gz):
    arrays = make_idx_set(tmp_path / folder, gz=gz)
    train, test = load_dataset(name, tmp_path)
    assert train.x.shape == (20, 1, 28, 28) and test.x.shape == (10, 1, 28, 28)
    assert train.y.tolist() == arrays["train-labels-idx1-ubyte"].tolist()
    expected = (arrays["t10k-images-idx3-ubyte"][:, None] / 255.0 - 0.1307) / 0.3081
    assert np.allclose(test.x.numpy(), expected, atol=1e-5)


def test_read_idx_rejects_garbage(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x01\x02\x03\x04rest")
    with pytest.raises(DatasetError, match="IDX"):
        read_idx(bad)
    short = tmp_path / "short"
    write_idx(short, np.zeros((3, 4), np.uint8), gz=False)
    short.write_bytes(short.read_bytes()[:-1])
    with pytest.raises(DatasetError, match="size"):
        read_idx(short)


# ----------------------------------------------------------------------------- CIFAR-10

def test_cifar_torchvision_pickles(tmp_path):
    src = make_cifar_batches(tmp_path)
    train, test = load_dataset("cifar10", tmp_path)
    assert train.x.shape == (20, 3, 32, 32) and test.x.shape == (4, 3, 32, 32)
    assert train.y.tolist() == src["y_train"].tolist() and test.y.tolist() == src["y_test"].tolist()
    mean = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
    std = torch.tensor([0.2023, 0.1994, 0.2010]).view(1, 3, 1, 1)
    raw = (train.x * std + mean) * 255
    assert torch.allclose(raw, torch.from_numpy(src["x_train"]).float(), atol=1e-3)


def test_cifar_npz_format_and_cache(tmp_path):
    src = make_cifar_npz(tmp_path)
    cache = tmp_path / "xdg-cache" / "flchurn"
    train, test = load_dataset("cifar10", tmp_path)
    assert train.x.shape == (12, 3, 32, 32) and test.x.shape == (6, 3, 32, 32)
    assert train.y.tolist() == (np.arange(12) % 10).tolist()
    mean = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
    std = torch.tensor([0.2023, 0.1994, 0.2010]).view(1, 3, 1, 1)
    raw = (test.x * std + mean) * 255
    # JPEG is lossy: flat colour blocks come back close, channel order (RGB, NCHW) preserved
    want = torch.from_numpy(src["x_test"]).float()
    err = (raw - want).abs().mean()
    assert err < 20
    assert err < 0.5 * (raw - want[:, [2, 1, 0]]).abs().mean()  # not BGR
    assert err < 0.5 * (raw - want.transpose(2, 3)).abs().mean()  # not H/W swapped
    assert len(list(cache.glob("cifar10-*.npy"))) == 4
    again, _ = load_dataset("cifar10", tmp_path)  # from the cache
    assert torch.equal(again.x, train.x) and torch.equal(again.y, train.y)
    nocache, _ = load_dataset("cifar10", tmp_path, cache=False)
    assert torch.equal(nocache.x, train.x)


def test_cifar_npz_wins_over_pickles(tmp_path):
    make_cifar_batches(tmp_path)
    make_cifar_npz(tmp_path)
    train, _ = load_dataset("cifar10", tmp_path, cache=False)
    assert len(train) == 12


@pytest.mark.skipif(os.environ.get("FLCHURN_REAL_CIFAR") != "1",
                    reason="decodes the real 60k-JPEG file (~5 s); set FLCHURN_REAL_CIFAR=1")
def test_cifar_real_npz():
    root = _need_shared("cifar10/cifar10-jpeg-q75.npz")
    train, test = load_dataset("cifar10", root)
    assert train.x.shape == (50000, 3, 32, 32) and test.x.shape == (10000, 3, 32, 32)
    assert train.y.bincount().tolist() == [5000] * 10 and test.y.bincount().tolist() == [1000] * 10
    assert train.x.mean(dim=(0, 2, 3)).abs().max() < 0.05  # the constants are CIFAR-10's means


# ----------------------------------------------------------------------------- SVHN, CINIC-10

@pytest.mark.parametrize("sub", ["", "svhn"])
def test_svhn_mat(tmp_path, sub):
    (tmp_path / sub).mkdir(exist_ok=True)
    src = make_svhn_mat(tmp_path / sub)
    train, test = load_dataset("svhn", tmp_path)
    assert train.x.shape == (7, 3, 32, 32) and test.x.shape == (5, 3, 32, 32)
    assert train.y.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert test.y.tolist() == [1, 2, 3, 4, 5]
    mean = torch.tensor([0.4377, 0.4438, 0.4728]).view(1, 3, 1, 1)
    std = torch.tensor([0.1980, 0.2010, 0.1970]).view(1, 3, 1, 1)
    raw = (train.x * std + mean) * 255
    expected = np.transpose(src["x_train"], (3, 2, 0, 1))  # torchvision's transpose
    assert torch.allclose(raw, torch.from_numpy(expected).float(), atol=1e-3)


def test_svhn_label_ten_is_zero(tmp_path):
    import scipy.io

    x = np.zeros((32, 32, 3, 3), np.uint8)
    for f in ("train_32x32.mat", "test_32x32.mat"):
        scipy.io.savemat(str(tmp_path / f), {"X": x, "y": np.array([[10], [1], [10]], np.uint8)})
    train, _ = load_dataset("svhn", tmp_path)
    assert train.y.tolist() == [0, 1, 0]


@pytest.mark.parametrize("use_valid", [False, True])
def test_cinic_image_folder(tmp_path, use_valid):
    make_cinic(tmp_path)
    train, test = load_dataset("cinic10", tmp_path, use_valid=use_valid)
    per_class = 3 if use_valid else 2
    assert train.x.shape == (per_class * len(CINIC_CLASSES), 3, 32, 32)
    assert test.x.shape == (len(CINIC_CLASSES), 3, 32, 32)
    assert train.y.bincount().tolist() == [per_class] * len(CINIC_CLASSES)  # sorted class folders
    assert train.num_classes == 10
    mean = torch.tensor([0.4789, 0.4723, 0.4305]).view(1, 3, 1, 1)
    std = torch.tensor([0.2421, 0.2383, 0.2587]).view(1, 3, 1, 1)
    raw = (train.x * std + mean) * 255
    assert (raw - raw.round()).abs().max() < 1e-3 and raw.min() > -0.01 and raw.max() < 255.01


# ----------------------------------------------------------------------------- generated

def test_synthetic_shapes_determinism_and_heterogeneity():
    a, at = load_dataset("synthetic", num_clients=12, seed=5, alpha=1.0, beta=1.0)
    b, _ = load_dataset("synthetic", num_clients=12, seed=5, alpha=1.0, beta=1.0)
    c, _ = load_dataset("synthetic", num_clients=12, seed=6, alpha=1.0, beta=1.0)
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y) and np.array_equal(a.groups, b.groups)
    assert a.x.shape != c.x.shape or not torch.equal(a.x, c.x)
    assert a.x.shape[1] == 60 and a.x.dtype == torch.float32 and a.num_classes == 10
    assert set(np.unique(a.groups)) == set(range(12)) == set(np.unique(at.groups))
    sizes = np.bincount(a.groups) + np.bincount(at.groups)
    assert (sizes >= 50).all()
    assert np.allclose(np.bincount(at.groups) / sizes, 0.2, atol=0.02)
    # label distributions differ across clients (non-IID): majority labels are not all the same
    majority = [np.bincount(a.y.numpy()[a.groups == k], minlength=10).argmax() for k in range(12)]
    assert len(set(majority)) > 1
    assert a.y.min() >= 0 and a.y.max() < 10


def test_synthetic_alpha_beta_zero_is_less_heterogeneous():
    def spread(alpha, beta):
        tr, _ = load_dataset("synthetic", num_clients=20, seed=1, alpha=alpha, beta=beta)
        means = np.stack([tr.x.numpy()[tr.groups == k].mean(0) for k in range(20)])
        return means.std(0).mean()

    assert spread(0.0, 0.0) < spread(1.0, 1.0)


def test_quadratic():
    train, test = load_dataset("quadratic", num_clients=7, seed=2, dim=4, spread=3.0)
    assert train.x.shape == (7, 4) and train.num_classes == 0
    assert train.y.tolist() == list(range(7)) and train.groups.tolist() == list(range(7))
    assert torch.equal(test.x, train.x)
    again, _ = load_dataset("quadratic", num_clients=7, seed=2, dim=4, spread=3.0)
    other, _ = load_dataset("quadratic", num_clients=7, seed=3, dim=4, spread=3.0)
    assert torch.equal(again.x, train.x) and not torch.equal(other.x, train.x)
    big, _ = load_dataset("quadratic", num_clients=2000, seed=0, dim=3, spread=3.0)
    assert abs(big.x.std().item() - 3.0) < 0.15


@pytest.mark.parametrize("name", ["synthetic", "quadratic"])
def test_generated_need_num_clients(name):
    with pytest.raises(DatasetError, match="num_clients"):
        load_dataset(name)


# ----------------------------------------------------------------------------- errors

def test_unknown_dataset_lists_known():
    with pytest.raises(DatasetError) as err:
        load_dataset("imagenet", "/nowhere")
    for name in DATASETS:
        assert name in str(err.value)


def test_unknown_parameter():
    with pytest.raises(DatasetError, match="alpha"):
        load_dataset("quadratic", num_clients=3, alpha=1.0)
    with pytest.raises(DatasetError, match="use_valid"):
        load_dataset("cifar10", "/nowhere", use_valid=True)


@pytest.mark.parametrize("name,files", [
    ("mnist", ["train-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]),
    ("fashion-mnist", ["train-labels-idx1-ubyte"]),
    ("cifar10", ["cifar10-jpeg-q75.npz", "cifar-10-batches-py"]),
    ("svhn", ["train_32x32.mat", "test_32x32.mat"]),
    ("cinic10", ["train/<class>/*.png"]),
])
def test_missing_files_name_files_and_dirs(tmp_path, name, files):
    with pytest.raises(DatasetError) as err:
        load_dataset(name, tmp_path)
    msg = str(err.value)
    for f in files:
        assert f in msg
    assert str(tmp_path) in msg
    assert "data-dir" in msg  # run-config spellings, not Python argument names
    assert ("download=true" in msg and "README" in msg) or "datashare" in msg


def test_partial_idx_set_is_missing(tmp_path):
    make_idx_set(tmp_path / "mnist")
    (tmp_path / "mnist" / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DatasetError, match="t10k-labels-idx1-ubyte"):
        load_dataset("mnist", tmp_path)


def test_file_dataset_needs_data_dir():
    with pytest.raises(DatasetError, match="data-dir is empty"):
        load_dataset("mnist")


def test_normalise_per_channel():
    x = np.full((2, 3, 2, 2), 255, np.uint8)
    out = normalise(x, (0.5, 0.0, 1.0), (0.5, 1.0, 2.0))
    assert out.dtype == torch.float32
    assert out[:, 0].eq(1.0).all() and out[:, 1].eq(1.0).all() and out[:, 2].eq(0.0).all()
