"""The user's own model, dataset and partitioner, as plain Python objects (see docs/extending.md).

A run config names them by ``module:attr`` or by an installed package's entry point
(:mod:`runconfig.extensions`), with parameters after the name as a built-in's:

* model: ``factory(input_shape, num_classes, **params) -> torch.nn.Module`` (a class works too);
* dataset: ``loader(**params) -> data``, offered ``seed``, ``num_clients``, ``data_dir``,
  ``download`` when its signature takes them; data is a ``(train, test)`` pair of
  :class:`TensorData`, four arrays ``(x_train, y_train, x_test, y_test)``, a dict or
  ``datasets.DatasetDict`` with ``train`` and ``test`` ``datasets.Dataset`` splits, or a
  flwr-datasets ``FederatedDataset`` (its ``train`` and ``test`` splits). The object itself may be
  such data;
* partitioner: any flwr-datasets ``Partitioner`` (a class, a factory or an instance), run over a
  ``datasets.Dataset`` with columns ``label``, ``idx`` (the row) and ``x`` (the features,
  flattened), or a function returning one index array per client; it is offered
  ``num_partitions``, ``seed``, ``labels``, ``features`` and ``groups`` when it takes them.

* central evaluation: ``evaluate(model, test, **params) -> {metric: number}`` on the server, offered
  ``train``, ``parts`` (one index array into ``train`` per client), ``groups``, ``clusters``,
  ``label_dists``, ``num_classes`` and ``device`` when it takes them.

Parameters are checked against the object's own keyword defaults (a float default takes a
number, an int an integer; unknown keys are refused unless it takes ``**kwargs``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from availability.spec import Spec, SpecError, canonical_key, parse_params
from runconfig.extensions import ExtensionError, Reference, accepted, keyword_defaults

from .tensordata import DatasetError, TensorData


def spec_params(ref: Reference, fn: Callable[..., Any], skip: tuple[str, ...], what: str) -> dict[str, Any]:
    """The spec's parameters, typed by ``fn``'s keyword defaults, keyed by ``fn``'s own names."""
    given = parse_params(ref.params, what=f"{what} {ref.name!r}")
    allowed, var_kw = keyword_defaults(fn, skip)
    if var_kw:
        known = {canonical_key(k) for k in allowed}
        allowed.update({canonical_key(k): None for k in given if canonical_key(k) not in known})
    taken = Spec(ref.name, given).take(allowed, what=what)
    named = {canonical_key(k) for k in given}
    return {k: v for k, v in taken.items() if canonical_key(k) in named}


# ----------------------------------------------------------------------------- models

def user_model(ref: Reference, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Call the user's model factory; the result must be a ``torch.nn.Module``."""
    fn = ref.obj
    if not callable(fn):
        raise ExtensionError(f"model {ref.name!r} is a {type(fn).__name__}, not a factory "
                             "factory(input_shape, num_classes) -> torch.nn.Module")
    params = spec_params(ref, fn, ("input_shape", "num_classes"), "model")
    try:
        model = fn(tuple(input_shape), int(num_classes), **params)
    except TypeError as exc:
        raise ExtensionError(f"model {ref.name!r}: calling it as factory(input_shape, num_classes, "
                             f"**{sorted(params)}) failed: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise ExtensionError(f"model {ref.name!r} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def check_model(ref: Reference) -> None:
    """The spec's parameters fit the factory (before any data is loaded)."""
    if not callable(ref.obj):
        raise ExtensionError(f"model {ref.name!r} is a {type(ref.obj).__name__}, not a factory")
    spec_params(ref, ref.obj, ("input_shape", "num_classes"), "model")


# ----------------------------------------------------------------------------- datasets

_LABELS = ("label", "labels", "y", "target")
_FEATURES = ("x", "image", "img", "pixel_values", "features")


def _hf_split(ds: Any, what: str) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """A ``datasets.Dataset`` -> (x float32, y int64, number of classes when its label says)."""
    cols = list(ds.column_names)
    label = next((c for c in _LABELS if c in cols), None)
    if label is None:
        raise DatasetError(f"dataset {what}: no label column among {cols}; name it one of {_LABELS}")
    feature = next((c for c in _FEATURES if c in cols), None)
    table = ds.with_format("numpy")[:]  # column -> array (rows stacked)

    def column(name: str) -> np.ndarray:
        values = table[name]
        return np.stack([np.asarray(v) for v in values]) if isinstance(values, list) else np.asarray(values)

    y = torch.from_numpy(column(label).astype(np.int64).reshape(-1))
    if feature is not None:
        x = column(feature)
    else:
        rest = [c for c in cols if c != label]
        if not rest:
            raise DatasetError(f"dataset {what}: no feature columns besides {label!r}")
        x = np.stack([column(c).astype(np.float32) for c in rest], axis=1)
    if x.dtype == np.uint8:
        x = x.astype(np.float32) / 255.0
        if x.ndim == 3:  # (n, H, W) grey images
            x = x[:, None]
        elif x.ndim == 4 and x.shape[-1] in (1, 3, 4):  # (n, H, W, C) -> (n, C, H, W)
            x = x.transpose(0, 3, 1, 2)
    feat = ds.features.get(label)
    classes = getattr(feat, "num_classes", None)
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), y, classes


def _pair(train: tuple, test: tuple, classes: int | None) -> tuple[TensorData, TensorData]:
    xtr, ytr = (torch.as_tensor(np.asarray(v)) if not isinstance(v, torch.Tensor) else v for v in train)
    xte, yte = (torch.as_tensor(np.asarray(v)) if not isinstance(v, torch.Tensor) else v for v in test)
    ytr, yte = ytr.long().reshape(-1), yte.long().reshape(-1)
    if classes is None:
        classes = int(max(int(ytr.max()), int(yte.max()) if len(yte) else 0)) + 1
    return (TensorData(xtr.float(), ytr, int(classes)), TensorData(xte.float(), yte, int(classes)))


def as_tensor_data(data: Any, what: str) -> tuple[TensorData, TensorData]:
    """The user's data in any of the accepted forms (module docstring) -> (train, test)."""
    if isinstance(data, Sequence) and len(data) == 2 and all(isinstance(d, TensorData) for d in data):
        return data[0], data[1]
    if isinstance(data, Sequence) and not isinstance(data, str) and len(data) == 4:
        return _pair((data[0], data[1]), (data[2], data[3]), None)
    if hasattr(data, "load_split"):  # flwr-datasets FederatedDataset
        data = {"train": data.load_split("train"), "test": data.load_split("test")}
    if isinstance(data, Mapping) or hasattr(data, "keys"):
        if "train" not in data or "test" not in data:
            raise DatasetError(f"dataset {what}: expected 'train' and 'test' splits; got {list(data.keys())}")
        xtr, ytr, ctr = _hf_split(data["train"], what)
        xte, yte, cte = _hf_split(data["test"], what)
        return _pair((xtr, ytr), (xte, yte), ctr or cte)
    raise DatasetError(f"dataset {what} gave a {type(data).__name__}; expected (train, test) TensorData, "
                       "(x_train, y_train, x_test, y_test), a DatasetDict/dict of train and test "
                       "datasets.Dataset, or a FederatedDataset")


def user_dataset(ref: Reference, *, data_dir: str | None, download: bool, seed: int,
                 num_clients: int) -> tuple[TensorData, TensorData]:
    """Load the user's dataset (call it when it is a loader) as ``(train, test)``."""
    what = repr(ref.name)
    obj = ref.obj
    if callable(obj) and not hasattr(obj, "load_split"):
        params = spec_params(ref, obj, ("num_clients", "data_dir", "download"), "dataset")  # ``seed`` may be set
        offered = {"seed": seed, "num_clients": num_clients, "data_dir": data_dir, "download": download}
        obj = obj(**{**accepted(obj, offered), **params})
    elif ref.params:
        raise SpecError(f"dataset {what} is data, not a loader: it takes no parameters ({ref.params!r})")
    return as_tensor_data(obj, what)


# ----------------------------------------------------------------------------- partitioners

def _run_flwr_partitioner(part: Any, labels: np.ndarray, features: np.ndarray | None, n: int) -> list[np.ndarray]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        import datasets

        datasets.disable_progress_bars()
        columns: dict[str, Any] = {"label": labels, "idx": np.arange(len(labels), dtype=np.int64)}
        if features is not None:
            columns["x"] = np.asarray(features, dtype=np.float32).reshape(len(labels), -1)
        part.dataset = datasets.Dataset.from_dict(columns)
        if part.num_partitions != n:
            raise ExtensionError(f"partitioner makes {part.num_partitions} partitions; the run has "
                                 f"num-clients = {n}")
        return [np.asarray(part.load_partition(i).with_format("numpy")["idx"], dtype=np.int64) for i in range(n)]


def user_partition(ref: Reference, labels: np.ndarray, n: int, seed: int, *,
                   features: np.ndarray | None = None, groups: np.ndarray | None = None) -> list[np.ndarray]:
    """Split example indices with the user's partitioner; one int64 index array per client."""
    from flwr_datasets.partitioner import Partitioner

    obj = ref.obj
    skip = ("num_partitions", "labels", "features", "groups")  # a spec may set ``seed`` (default: data-seed)
    if isinstance(obj, Partitioner):
        if ref.params:
            raise SpecError(f"partitioner {ref.name!r} is an instance: it takes no parameters ({ref.params!r})")
        made: Any = obj
    elif callable(obj):
        params = spec_params(ref, obj, skip, "partitioner")
        offered = {"num_partitions": n, "seed": seed, "labels": labels, "features": features, "groups": groups}
        made = obj(**{**accepted(obj, offered), **params})
    else:
        raise ExtensionError(f"partitioner {ref.name!r} is a {type(obj).__name__}: expected a flwr-datasets "
                             "Partitioner (class, factory or instance) or a function returning index arrays")
    if isinstance(made, Partitioner):
        parts = _run_flwr_partitioner(made, labels, features, n)
    else:
        parts = [np.asarray(p, dtype=np.int64).reshape(-1) for p in made]
    if len(parts) != n:
        raise ExtensionError(f"partitioner {ref.name!r} returned {len(parts)} partitions for {n} clients")
    for i, p in enumerate(parts):
        if len(p) and (p.min() < 0 or p.max() >= len(labels)):
            raise ExtensionError(f"partitioner {ref.name!r}: client {i} has indices outside [0, {len(labels)})")
    return parts


# ----------------------------------------------------------------------------- central evaluation

#: what the server offers an evaluation function besides ``model`` and ``test`` (when it takes them)
EVALUATION_OFFERS = ("train", "parts", "groups", "clusters", "label_dists", "num_classes", "device")


def user_evaluation(ref: Reference) -> Callable[..., dict[str, float]]:
    """The user's central evaluation as ``f(model, test, **offered)``: ``fn(model, test, **params)``
    with the spec's parameters bound; it is offered :data:`EVALUATION_OFFERS` when it takes them
    and returns ``{metric name: number}``, recorded per round as ``test-<name>``."""
    fn = ref.obj
    if not callable(fn):
        raise ExtensionError(f"evaluation {ref.name!r} is a {type(fn).__name__}, not a function "
                             "evaluate(model, test, **params) -> dict of metrics")
    params = spec_params(ref, fn, ("model", "test", *EVALUATION_OFFERS), "evaluation")

    def evaluate(model: nn.Module, test: TensorData, **offered: Any) -> dict[str, float]:
        out = fn(model, test, **{**accepted(fn, offered), **params})
        if not isinstance(out, Mapping):
            raise ExtensionError(f"evaluation {ref.name!r} returned a {type(out).__name__}; expected a dict of "
                                 "metric name -> number")
        bad = [k for k, v in out.items() if not isinstance(k, str) or isinstance(v, bool)
               or not isinstance(v, (int, float, np.integer, np.floating))]
        if bad:
            raise ExtensionError(f"evaluation {ref.name!r}: metrics {bad[:5]} are not name -> number")
        return {k: float(v) for k, v in out.items()}

    return evaluate
