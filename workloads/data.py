"""Datasets as in-memory tensors: real image sets read from local files, and generated workloads.

``load_dataset(name, data_dir, ...)`` returns ``(train, test)`` :class:`TensorData`. Images are
float32 ``(n, C, H, W)`` normalised per channel with the constants the FedAU/FedAWE papers use
(see ``../shared/data/README.md``); tabular data is float32 ``(n, d)``.

File layouts searched (``data_dir`` is required for file-based datasets):

* ``mnist`` / ``fashion-mnist``: the four IDX files, gzipped or not, in
  ``data_dir/<mnist|fashion-mnist>/`` (the shared offline copy) or torchvision's
  ``data_dir/<MNIST|FashionMNIST>/raw/``.
* ``cifar10``: ``data_dir/cifar10/cifar10-jpeg-q75.npz`` (the shared, lossy JPEG-q75 copy; decoded
  once and cached as ``.npy`` under ``$XDG_CACHE_HOME/flchurn`` or ``~/.cache/flchurn``, keyed by
  the npz's sha256; ``cache=False`` turns this off) or torchvision's ``data_dir/cifar-10-batches-py/``.
* ``svhn``: torchvision's ``data_dir/{train,test}_32x32.mat`` (also ``data_dir/svhn/``); label 10 -> 0.
* ``cinic10``: ImageFolder ``data_dir/CINIC-10/{train,valid,test}/<class>/*.png`` (also
  ``data_dir/cinic10/``); train is ``train`` only unless ``use_valid=True`` (then train+valid).

Generated (no files; ``num_clients`` required): ``synthetic`` and ``quadratic``, see
:mod:`workloads.generated`.

Parameters follow the name as in every spec: ``synthetic:alpha=0.5,beta=0.5``, ``mnist:verify=true``,
``cinic10:use-valid=true``. The user's own data: a ``module:attr`` spec or an entry point (group
``flchurn.datasets``), see :mod:`workloads.extensions`.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from availability.spec import SpecError, canonical_key, parse_spec
from runconfig.extensions import Reference, resolve

from .cache import cache_dir, cache_put
from .extensions import user_dataset
from .generated import GENERATED
from .tensordata import DatasetError, TensorData

DATASETS: tuple[str, ...] = (
    "digits", "mnist", "fashion-mnist", "cifar10", "svhn", "cinic10", "synthetic", "quadratic",
)


README_HINT = (
    "point the run config's data-dir at the offline copy described in ../shared/data/README.md "
    "(an absolute path, e.g. --run-config \"data-dir='/abs/path/shared/data'\"), or set download=true "
    "to fetch it with torchvision (needs internet)"
)

# Uncompressed-content md5 of the official IDX files.
IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
MD5 = {
    "mnist": ("6bbc9ace898e44ae57da46a324031adb", "a25bea736e30d166cdddb491f175f624",
              "2646ac647ad5339dbf082846283269ea", "27ae3e4e09519cfbb04c329615203637"),
    "fashion-mnist": ("f4a8712d7a061bf5bd6d2ca38dc4d50a", "9018921c3c673c538a1fc5bad174d6f9",
                      "8181f5470baa50b63fa0f6fddb340f0a", "15d484375f8d13e6eb1aabb0c3f46965"),
}
CIFAR_NPZ = "cifar10-jpeg-q75.npz"
CIFAR_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)
SVHN_FILES = ("train_32x32.mat", "test_32x32.mat")

Raw = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # x_train, y_train, x_test, y_test


# ----------------------------------------------------------------------------- helpers

def _missing(name: str, files: Any, dirs: list[Path], extra: str = "") -> DatasetError:
    return DatasetError(
        f"dataset '{name}': could not find {list(files)} in any of "
        f"{[str(d) for d in dirs]}; {extra or README_HINT}"
    )


def _open_maybe_gz(path: Path) -> bytes:
    data = path.read_bytes()
    return gzip.decompress(data) if path.suffix == ".gz" else data


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Parse an IDX file (gzipped if its name ends in .gz) into a numpy array."""
    path = Path(path)
    data = _open_maybe_gz(path)
    types = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in types:
        raise DatasetError(f"{path}: not an IDX file (bad magic number {data[:4]!r})")
    ndim = data[3]
    shape = tuple(int(v) for v in np.frombuffer(data, ">i4", count=ndim, offset=4))
    dtype = np.dtype(types[data[2]])
    expected = 4 + 4 * ndim + int(np.prod(shape)) * dtype.itemsize
    if len(data) != expected:
        raise DatasetError(f"{path}: IDX size {len(data)} bytes, header implies {expected}")
    arr = np.frombuffer(data, dtype, offset=4 + 4 * ndim).reshape(shape)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def file_md5(path: str | os.PathLike) -> str:
    """md5 of a file's uncompressed content (gunzipped first if its name ends in .gz)."""
    return hashlib.md5(_open_maybe_gz(Path(path))).hexdigest()


def verify_md5(name: str, data_dir: str | os.PathLike) -> dict[str, str]:
    """Check the four IDX files of ``mnist``/``fashion-mnist`` against the official md5s.

    Returns {path: md5}; raises DatasetError naming the file on a mismatch.
    """
    if name not in MD5:
        raise DatasetError(f"no md5 table for {name!r}; known: {sorted(MD5)}")
    out = {}
    for path, expected in zip(_find_idx(name, Path(data_dir)), MD5[name], strict=True):
        got = file_md5(path)
        if got != expected:
            raise DatasetError(f"{path}: md5 of content is {got}, expected {expected}")
        out[str(path)] = got
    return out


def normalise(x: np.ndarray, mean: Any, std: Any) -> torch.Tensor:
    """uint8 (n, C, H, W) -> float32 ((x / 255) - mean) / std per channel."""
    t = torch.from_numpy(np.ascontiguousarray(x)).float().div_(255.0)
    shape = (1, -1) + (1,) * (t.dim() - 2)
    mean_t = torch.as_tensor(mean, dtype=torch.float32).reshape(shape)
    std_t = torch.as_tensor(std, dtype=torch.float32).reshape(shape)
    return t.sub_(mean_t).div_(std_t)


def _torchvision_download(cls_name: str, root: Path, **kwargs: Any) -> None:
    import torchvision.datasets as tvd  # only needed for downloads

    root.mkdir(parents=True, exist_ok=True)
    cls = getattr(tvd, cls_name)
    for split in kwargs.pop("splits"):
        cls(root=str(root), download=True, **split, **kwargs)


# ----------------------------------------------------------------------------- image loaders

def _load_digits(data_dir: Path | None, download: bool, seed: int, cache: bool = True, **_: Any) -> Raw:
    """scikit-learn's digits split 80/20 by ``seed``, cached per seed and scikit-learn version: importing
    scikit-learn was 8.2 of a deployed worker's 9.1 s digits build at load 22 on 2 cores (issue 40)."""
    from importlib.metadata import version
    file = cache_dir() / f"digits-sklearn{version('scikit-learn')}-s{seed}.npz"
    try:
        if cache and file.is_file():
            with np.load(file) as z:
                return z["xtr"], z["ytr"], z["xte"], z["yte"]
    except (OSError, ValueError, KeyError):
        pass  # a corrupt cache: split again
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    d = load_digits()
    x, y = (d.images.astype(np.float32) / 16.0)[:, None], d.target.astype(np.int64)  # x: (1797, 1, 8, 8) in [0, 1]
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, stratify=y, random_state=seed)
    if cache:
        cache_put(file, lambda fh: np.savez(fh, xtr=xtr, ytr=ytr, xte=xte, yte=yte))
    return xtr, ytr, xte, yte


def _find_idx(name: str, data_dir: Path) -> list[Path]:
    tv = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST"}[name]
    dirs = [data_dir / name, data_dir / tv / "raw"]
    for d in dirs:
        found = []
        for f in IDX_FILES:
            cands = [d / (f + ".gz"), d / f]
            found.append(next((c for c in cands if c.is_file()), None))
        if all(found):
            return found  # type: ignore[return-value]
    raise _missing(name, [f + "[.gz]" for f in IDX_FILES], dirs)


def _load_idx_dataset(name: str):
    def load(data_dir: Path, download: bool, seed: int, verify: bool = False, **_: Any) -> Raw:
        try:
            paths = _find_idx(name, data_dir)
        except DatasetError:
            if not download:
                raise
            cls = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST"}[name]
            _torchvision_download(cls, data_dir, splits=[{"train": True}, {"train": False}])
            paths = _find_idx(name, data_dir)
        if verify:
            verify_md5(name, data_dir)
        xtr, ytr, xte, yte = (read_idx(p) for p in paths)
        return xtr[:, None], ytr.astype(np.int64), xte[:, None], yte.astype(np.int64)

    return load


def _decode_jpegs(blob: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    from PIL import Image

    raw = blob.tobytes()
    n = len(offsets) - 1
    out = np.empty((n, 32, 32, 3), np.uint8)
    for i in range(n):
        img = Image.open(io.BytesIO(raw[offsets[i]:offsets[i + 1]])).convert("RGB")
        out[i] = np.asarray(img)
    return out.transpose(0, 3, 1, 2)  # NCHW view


def _load_cifar_npz(path: Path, cache: bool) -> Raw:
    key = None
    if cache:
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
        key = h.hexdigest()[:16]
        files = [cache_dir() / f"cifar10-{key}-{s}.npy" for s in ("xtr", "ytr", "xte", "yte")]
        if all(f.is_file() for f in files):
            try:
                return tuple(np.load(f) for f in files)
            except (OSError, ValueError):
                pass  # corrupt cache: decode again
    with np.load(path) as z:
        out = (_decode_jpegs(z["train_jpeg"], z["train_offsets"]),
               z["train_labels"].astype(np.int64),
               _decode_jpegs(z["test_jpeg"], z["test_offsets"]),
               z["test_labels"].astype(np.int64))
    if key is not None:
        for f, arr in zip(files, out, strict=True):
            cache_put(f, lambda fh, a=arr: np.save(fh, np.ascontiguousarray(a)))  # type: ignore[misc]
    return out


def _load_cifar10(data_dir: Path, download: bool, seed: int, cache: bool = True, **_: Any) -> Raw:
    npz = data_dir / "cifar10" / CIFAR_NPZ
    if npz.is_file():
        return _load_cifar_npz(npz, cache)
    pdir = data_dir / "cifar-10-batches-py"
    if not all((pdir / b).is_file() for b in CIFAR_BATCHES):
        if not download:
            raise _missing("cifar10", [CIFAR_NPZ, "cifar-10-batches-py/" + "{data_batch_1..5,test_batch}"],
                           [npz.parent, pdir])
        _torchvision_download("CIFAR10", data_dir, splits=[{"train": True}, {"train": False}])
    parts = []
    for b in CIFAR_BATCHES:
        with open(pdir / b, "rb") as fh:
            d = pickle.load(fh, encoding="bytes")
        d = {k.decode() if isinstance(k, bytes) else k: v for k, v in d.items()}
        parts.append((np.asarray(d["data"], np.uint8).reshape(-1, 3, 32, 32),
                      np.asarray(d["labels"], np.int64)))
    return (np.concatenate([p[0] for p in parts[:5]]), np.concatenate([p[1] for p in parts[:5]]),
            parts[5][0], parts[5][1])


def _load_svhn(data_dir: Path, download: bool, seed: int, **_: Any) -> Raw:
    dirs = [data_dir, data_dir / "svhn"]
    d = next((d for d in dirs if all((d / f).is_file() for f in SVHN_FILES)), None)
    if d is None:
        if not download:
            raise _missing("svhn", SVHN_FILES, dirs)
        _torchvision_download("SVHN", data_dir, splits=[{"split": "train"}, {"split": "test"}])
        d = data_dir
    import scipy.io

    out: list[np.ndarray] = []
    for f in SVHN_FILES:
        m = scipy.io.loadmat(str(d / f))
        y = m["y"].astype(np.int64).reshape(-1)
        y[y == 10] = 0  # as torchvision
        out += [np.transpose(m["X"], (3, 2, 0, 1)).astype(np.uint8), y]
    return tuple(out)  # type: ignore[return-value]


def _load_cinic10(data_dir: Path, download: bool, seed: int, use_valid: bool = False,
                  **_: Any) -> Raw:
    from PIL import Image

    dirs = [data_dir / "CINIC-10", data_dir / "cinic10"]
    root = next((d for d in dirs if (d / "train").is_dir() and (d / "test").is_dir()), None)
    if root is None:
        raise _missing("cinic10", ["train/<class>/*.png", "test/<class>/*.png"], dirs,
                       "download CINIC-10 from https://datashare.ed.ac.uk/handle/10283/3192 and "
                       "extract it to <data-dir>/CINIC-10 (torchvision cannot download it)")
    classes = sorted(p.name for p in (root / "train").iterdir() if p.is_dir())
    if not classes:
        raise DatasetError(f"cinic10: no class folders under {root / 'train'}")

    def read(splits: list[str]) -> tuple[np.ndarray, np.ndarray]:
        xs, ys = [], []
        for split in splits:
            for label, cls in enumerate(classes):
                for f in sorted((root / split / cls).glob("*.png")):
                    xs.append(np.asarray(Image.open(f).convert("RGB")))
                    ys.append(label)
        if not xs:
            raise DatasetError(f"cinic10: no .png images under {[str(root / s) for s in splits]}")
        return np.stack(xs).transpose(0, 3, 1, 2), np.asarray(ys, np.int64)

    return read(["train", "valid"] if use_valid else ["train"]) + read(["test"])


# ----------------------------------------------------------------------------- table + entry

_MNIST_NORM = ((0.1307,), (0.3081,))
# name -> (loader, mean, std, num_classes, allowed params); mean None = own train mean/std.
_IMAGES: dict[str, tuple[Callable[..., Raw], Any, Any, int, dict[str, Any]]] = {
    "digits": (_load_digits, None, None, 10, {"cache": True}),
    "mnist": (_load_idx_dataset("mnist"), *_MNIST_NORM, 10, {"verify": False}),
    "fashion-mnist": (_load_idx_dataset("fashion-mnist"), *_MNIST_NORM, 10, {"verify": False}),
    "cifar10": (_load_cifar10, (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010), 10,
                {"cache": True}),
    "svhn": (_load_svhn, (0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970), 10, {}),
    "cinic10": (_load_cinic10, (0.4789, 0.4723, 0.4305), (0.2421, 0.2383, 0.2587), 10,
                {"use_valid": False}),
}



def _check_params(name: str, params: dict[str, Any], allowed: dict[str, Any]) -> None:
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise DatasetError(f"dataset '{name}': unknown parameter(s) {unknown}; "
                           f"allowed: {sorted(allowed) or 'none'}")


def dataset_reference(spec: str) -> Reference | None:
    """The user's dataset a spec names (``module:attr`` or an entry point), None for a built-in."""
    return resolve(spec, "dataset", builtin=lambda name: name in DATASETS)


def dataset_name(spec: str) -> str:
    """The name a dataset spec stands for (``fashion-mnist`` for ``fashion-mnist:verify=true``;
    ``module:attr`` for the user's): what picks the ``cnn`` model's head."""
    ref = dataset_reference(spec)
    if ref is not None:
        return ref.name
    try:
        return parse_spec(spec).name
    except SpecError as exc:
        raise DatasetError(f"dataset {spec!r}: {exc}") from exc


def load_dataset(name: str, data_dir: str | os.PathLike | None = None, *, download: bool = False,
                 seed: int = 0, num_clients: int | None = None,
                 **params: Any) -> tuple[TensorData, TensorData]:
    """Load ``name`` (one of DATASETS, with its parameters after a colon: ``synthetic:alpha=0.5``;
    or the user's ``module:attr`` / entry point) as ``(train, test)``; see the module docstring."""
    if not isinstance(name, str):
        raise DatasetError(f"dataset must be a spec string; got {name!r}")
    ref = dataset_reference(name)
    if ref is not None:
        return user_dataset(ref, data_dir=None if data_dir is None else str(data_dir), download=download,
                            seed=seed, num_clients=0 if num_clients is None else int(num_clients))
    try:
        parsed = parse_spec(name)
    except SpecError as exc:
        raise DatasetError(f"dataset {name!r}: {exc}") from exc
    key = parsed.name
    params = {canonical_key(k): v for k, v in {**parsed.params, **params}.items()}
    if key in GENERATED:
        fn, allowed = GENERATED[key]
        _check_params(key, params, allowed)
        if num_clients is None or int(num_clients) < 1:
            raise DatasetError(f"dataset '{key}' is generated per client: pass num_clients >= 1")
        return fn(int(num_clients), seed, **params)
    if key not in _IMAGES:
        raise DatasetError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    loader, mean, std, num_classes, allowed = _IMAGES[key]
    _check_params(key, params, allowed)
    if data_dir is None and key != "digits":
        raise DatasetError(f"dataset '{key}' is read from files but the run config's data-dir is empty: "
                           f"set data-dir to the folder holding '{key}/' or torchvision's layout; {README_HINT}")
    root = Path(data_dir).expanduser() if data_dir is not None else None
    xtr, ytr, xte, yte = loader(root, download, seed, **params)
    if mean is None:  # digits: floats in [0, 1], scalar train statistics
        m, s = float(xtr.mean()), float(xtr.std())
        xtr_t = torch.from_numpy((xtr - m) / s).float()
        xte_t = torch.from_numpy((xte - m) / s).float()
    else:
        xtr_t, xte_t = normalise(xtr, mean, std), normalise(xte, mean, std)
    return (TensorData(xtr_t, torch.from_numpy(np.asarray(ytr, np.int64)), num_classes),
            TensorData(xte_t, torch.from_numpy(np.asarray(yte, np.int64)), num_classes))
