"""Model zoo: ``build_model(spec, input_shape, num_classes, dataset=...)``.

A model is named by a spec in the grammar of :mod:`availability.spec` (``name`` or
``name:key=value``); only ``cnn`` has a parameter so far. The user's own model is a
``module:attr`` spec (``mynets:resnet8:width=32``) or an installed entry point
(group ``flchurn.models``): any ``factory(input_shape, num_classes, **params) -> nn.Module``
(:mod:`workloads.extensions`).

- ``cnn:init=kaiming``: the FedAU (Wang & Ji, NeurIPS 2023) / FedAWE (Xiang et al., NeurIPS 2024)
  CNN: two 3x3 convolutions with 32 channels (padding 1), each followed by ReLU and 2x2
  max-pooling, then a fully connected head chosen by dataset (CIFAR-10 2048-256-64-10, SVHN
  2048-128-10, CINIC-10 with Dropout(0.2) before each linear layer 2048-512-256-10,
  Fashion-MNIST/MNIST 1568-128-10, anything else flatten-128-num_classes).
  ``init=kaiming`` (default): Kaiming-normal (fan_in, ReLU gain) weights and zero biases in every
  layer. ``init=official``: as the official code (github.com/IBM/fedau ``model/cnn_*.py``, which
  mingxiang12/FedAWE's ``model/model.py`` imports): Kaiming and zero biases for the convolutions
  and the hidden linear layers only (``self.conv.apply(init_weights); self.fc1.apply(...)``),
  the output layer ``fc2`` keeps PyTorch's default (weights and biases U(±1/√fan_in)). With the
  Kaiming output layer, η_0 = 0.1 diverged in round 0 for 13 of 100 Fashion-MNIST clients, 1 of
  100 with the official init (measured by a tester, issue 9).
- ``fedavg-cnn``: the MNIST CNN of McMahan et al. (AISTATS 2017): 5x5 conv 32, pool, 5x5 conv 64,
  pool, fc 512, fc classes (1,663,370 parameters on 1x28x28). PyTorch default init.
- ``mlp``: the FedAvg "2NN", two hidden layers of 200 ReLU units (199,210 parameters on MNIST).
- ``logreg``: multinomial logistic regression, flatten + one linear layer.
- ``vgg11``: VGG-11 (config A) without batch norm for 32x32 inputs, as in the FedNova code
  (Wang et al., NeurIPS 2020): 9,750,922 parameters for 3x32x32 and 10 classes. Conv weights
  N(0, 2/(k*k*out_channels)), zero biases (the FedNova/pytorch-vgg-cifar10 init).
- ``quadratic``: one parameter ``x`` (dim,), zero at start; ``forward(e)`` returns the per-example
  loss 0.5*||x - e||^2. Its ``is_regression = True`` tells training to use the output (mean)
  as the loss; every other model returns logits for cross-entropy (``is_regression = False``).
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn

from availability.spec import parse_spec
from runconfig.extensions import Reference, resolve

from .extensions import check_model, user_model

MODELS: tuple[str, ...] = ("cnn", "fedavg-cnn", "mlp", "logreg", "vgg11", "quadratic")

# Hidden widths and dropout of the ``cnn`` head, by normalised dataset name (FedAU/FedAWE code).
_CNN_HEADS: dict[str, tuple[tuple[int, ...], float]] = {
    "cifar10": ((256, 64), 0.0),
    "svhn": ((128,), 0.0),
    "cinic10": ((512, 256), 0.2),
    "fashionmnist": ((128,), 0.0),
    "fmnist": ((128,), 0.0),
    "mnist": ((128,), 0.0),
}
_DEFAULT_HEAD: tuple[tuple[int, ...], float] = ((128,), 0.0)
_PARAMS: dict[str, dict[str, str]] = {"cnn": {"init": "kaiming"}}  # model -> parameter -> default
CNN_INITS = ("kaiming", "official")
_VGG11 = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


def _norm_dataset(dataset: str | None) -> str:
    return "" if dataset is None else dataset.lower().replace("-", "").replace("_", "")


def _image_shape(
    name: str, input_shape: tuple[int, ...], min_side: int
) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ValueError(
            f"model '{name}' needs an image input (C, H, W); got {input_shape}"
        )
    c, h, w = input_shape
    if min(h, w) < min_side:
        raise ValueError(
            f"model '{name}' needs H, W >= {min_side}; got input {input_shape}"
        )
    return c, h, w


def _mlp(sizes: list[int], dropout: float = 0.0) -> list[nn.Module]:
    """Linear layers sizes[0] -> ... -> sizes[-1], ReLU between; dropout before each linear layer."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return layers


class Classifier(nn.Sequential):
    """A ``Sequential`` that returns logits; training applies cross-entropy."""

    is_regression = False


class Quadratic(nn.Module):
    """F(x; e) = 0.5 * ||x - e||^2 per example; exact gradient x - e (closed-form checks)."""

    is_regression = True

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.x = nn.Parameter(torch.zeros(dim))

    def forward(self, e: torch.Tensor) -> torch.Tensor:
        return 0.5 * (self.x - e.reshape(e.shape[0], -1)).pow(2).sum(dim=1)


def _cnn(
    input_shape: tuple[int, ...], num_classes: int, dataset: str | None, init: str = "kaiming"
) -> Classifier:
    c, h, w = _image_shape("cnn", input_shape, 4)
    hidden, dropout = _CNN_HEADS.get(_norm_dataset(dataset), _DEFAULT_HEAD)
    flat = 32 * (h // 4) * (w // 4)
    model = Classifier(
        nn.Conv2d(c, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        *_mlp([flat, *hidden, num_classes], dropout),
    )
    if init not in CNN_INITS:
        raise ValueError(f"model 'cnn': init={init!r}; choose one of {', '.join(CNN_INITS)}")
    layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    for m in layers[:-1] if init == "official" else layers:  # official: output layer left alone
        nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    return model


def _fedavg_cnn(input_shape: tuple[int, ...], num_classes: int) -> Classifier:
    c, h, w = _image_shape("fedavg-cnn", input_shape, 4)
    return Classifier(
        nn.Conv2d(c, 32, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * (h // 4) * (w // 4), 512),
        nn.ReLU(),
        nn.Linear(512, num_classes),
    )


def _vgg11(input_shape: tuple[int, ...], num_classes: int) -> Classifier:
    c, h, w = _image_shape("vgg11", input_shape, 1)
    if (h, w) != (32, 32):
        raise ValueError(
            f"model 'vgg11' needs 32x32 inputs (5 poolings to 1x1x512); got {input_shape}"
        )
    layers: list[nn.Module] = []
    for v in _VGG11:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(c, int(v), 3, padding=1), nn.ReLU(inplace=True)]
            c = int(v)
    model = Classifier(
        *layers,
        nn.Flatten(),
        nn.Dropout(),
        nn.Linear(512, 512),
        nn.ReLU(inplace=True),
        nn.Dropout(),
        nn.Linear(512, 512),
        nn.ReLU(inplace=True),
        nn.Linear(512, num_classes),
    )
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            n = m.kernel_size[0] * m.kernel_size[1] * m.out_channels
            nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 / n))
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    return model


def model_reference(spec: str) -> Reference | None:
    """The user's model factory a spec names (``module:attr`` or an entry point), None for a built-in."""
    return resolve(spec, "model", builtin=lambda name: name in MODELS)


def model_params(spec: str) -> tuple[str, dict[str, str]]:
    """(name, parameters with defaults) of a model spec; ValueError naming the problem."""
    ref = model_reference(spec)
    if ref is not None:
        check_model(ref)
        return ref.name, {}
    parsed = parse_spec(spec)
    if parsed.name not in MODELS:
        raise ValueError(f"unknown model {parsed.name!r}; choose one of {', '.join(MODELS)}")
    return parsed.name, parsed.take(_PARAMS.get(parsed.name, {}), what="model")


def build_model(
    spec: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    dataset: str | None = None,
) -> nn.Module:
    """Build model ``spec`` for inputs of ``input_shape`` (no batch dim) and ``num_classes``.

    ``dataset`` only picks the ``cnn`` head (case, '-' and '_' ignored: ``cifar-10`` = ``cifar10``);
    ``quadratic`` takes ``input_shape = (dim,)`` and ignores ``num_classes``. A ``module:attr`` spec
    or an entry point's name calls the user's ``factory(input_shape, num_classes, **params)``.
    """
    ref = model_reference(spec)
    if ref is not None:
        return user_model(ref, tuple(int(s) for s in input_shape), num_classes)
    name, params = model_params(spec)
    shape = tuple(int(s) for s in input_shape)
    if not shape or any(s < 1 for s in shape):
        raise ValueError(
            f"input_shape must be non-empty positive ints; got {input_shape}"
        )
    if name == "quadratic":
        if len(shape) != 1:
            raise ValueError(
                f"model 'quadratic' needs input_shape (dim,); got {input_shape}"
            )
        return Quadratic(shape[0])
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1; got {num_classes}")
    flat = math.prod(shape)
    if name == "cnn":
        return _cnn(shape, num_classes, dataset, **params)
    if name == "fedavg-cnn":
        return _fedavg_cnn(shape, num_classes)
    if name == "mlp":
        return Classifier(nn.Flatten(), *_mlp([flat, 200, 200, num_classes]))
    if name == "logreg":
        return Classifier(nn.Flatten(), nn.Linear(flat, num_classes))
    if name == "vgg11":
        return _vgg11(shape, num_classes)
    raise AssertionError(f"model {name!r} is listed in MODELS but not built here")
