"""Model zoo: exact parameter counts, forward shapes, init determinism, errors."""

from __future__ import annotations

import pytest
import torch

from workloads.models import MODELS, build_model


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def conv(cin: int, cout: int, k: int) -> int:
    return cin * k * k * cout + cout


def fc(a: int, b: int) -> int:
    return a * b + b


CNN_BODY_RGB = conv(3, 32, 3) + conv(32, 32, 3)
CNN_BODY_GRAY = conv(1, 32, 3) + conv(32, 32, 3)


@pytest.mark.parametrize(
    ("name", "shape", "classes", "dataset", "expected"),
    [
        (
            "cnn",
            (3, 32, 32),
            10,
            "cifar10",
            CNN_BODY_RGB + fc(2048, 256) + fc(256, 64) + fc(64, 10),
        ),
        ("cnn", (3, 32, 32), 10, "svhn", CNN_BODY_RGB + fc(2048, 128) + fc(128, 10)),
        (
            "cnn",
            (3, 32, 32),
            10,
            "cinic10",
            CNN_BODY_RGB + fc(2048, 512) + fc(512, 256) + fc(256, 10),
        ),
        (
            "cnn",
            (1, 28, 28),
            10,
            "fashion-mnist",
            CNN_BODY_GRAY + fc(1568, 128) + fc(128, 10),
        ),
        ("cnn", (1, 28, 28), 10, "mnist", CNN_BODY_GRAY + fc(1568, 128) + fc(128, 10)),
        (
            "cnn",
            (1, 8, 8),
            10,
            "digits",
            CNN_BODY_GRAY + fc(32 * 2 * 2, 128) + fc(128, 10),
        ),
        ("fedavg-cnn", (1, 28, 28), 10, None, 1_663_370),
        (
            "fedavg-cnn",
            (1, 28, 28),
            10,
            None,
            conv(1, 32, 5) + conv(32, 64, 5) + fc(64 * 7 * 7, 512) + fc(512, 10),
        ),
        ("mlp", (1, 28, 28), 10, None, 199_210),
        ("mlp", (1, 28, 28), 10, None, fc(784, 200) + fc(200, 200) + fc(200, 10)),
        ("logreg", (1, 8, 8), 10, None, fc(64, 10)),
        ("logreg", (3, 32, 32), 10, None, fc(3072, 10)),
        ("vgg11", (3, 32, 32), 10, None, 9_750_922),
        (
            "vgg11",
            (3, 32, 32),
            10,
            None,
            conv(3, 64, 3)
            + conv(64, 128, 3)
            + conv(128, 256, 3)
            + conv(256, 256, 3)
            + conv(256, 512, 3)
            + 3 * conv(512, 512, 3)
            + 2 * fc(512, 512)
            + fc(512, 10),
        ),
        ("quadratic", (7,), 1, None, 7),
    ],
)
def test_param_counts(name, shape, classes, dataset, expected):
    assert n_params(build_model(name, shape, classes, dataset=dataset)) == expected


def test_cifar_dataset_name_variants_and_cinic_dropout():
    a = build_model("cnn", (3, 32, 32), 10, dataset="CIFAR-10")
    b = build_model("cnn", (3, 32, 32), 10, dataset="cifar10")
    assert n_params(a) == n_params(b)
    cinic = build_model("cnn", (3, 32, 32), 10, dataset="cinic-10")
    kinds = [type(m).__name__ for m in cinic]
    head = kinds[kinds.index("Flatten") + 1 :]
    # IBM/fedau model/cnn_cinic10.py: Dropout(0.2) before each of the three linear layers
    assert head == ["Dropout", "Linear", "ReLU", "Dropout", "Linear", "ReLU", "Dropout", "Linear"]
    assert all(m.p == 0.2 for m in cinic if isinstance(m, torch.nn.Dropout))


SHAPES = [
    ((1, 8, 8), "digits"),
    ((1, 28, 28), "fashion-mnist"),
    ((3, 32, 32), "cifar10"),
    ((3, 32, 32), "svhn"),
    ((3, 32, 32), "cinic10"),
]


@pytest.mark.parametrize("name", ["cnn", "fedavg-cnn", "mlp", "logreg", "vgg11"])
@pytest.mark.parametrize(("shape", "dataset"), SHAPES)
def test_forward_shapes(name, shape, dataset):
    if name == "vgg11" and shape[1:] != (32, 32):
        with pytest.raises(ValueError, match="32x32"):
            build_model(name, shape, 10, dataset=dataset)
        return
    model = build_model(name, shape, 7, dataset=dataset)
    assert model.is_regression is False
    model.eval()
    with torch.no_grad():
        out = model(torch.randn(3, *shape))
    assert out.shape == (3, 7)


def test_quadratic_forward_and_flag():
    model = build_model("quadratic", (3,), 1)
    assert model.is_regression is True
    assert torch.equal(model.x.detach(), torch.zeros(3))
    e = torch.tensor([[1.0, 2.0, 2.0], [0.0, 0.0, 0.0]])
    assert torch.allclose(model(e), torch.tensor([4.5, 0.0]))


@pytest.mark.parametrize("name", MODELS)
def test_init_deterministic_under_seed(name):
    shape = (4,) if name == "quadratic" else (3, 32, 32)
    states = []
    for _ in range(2):
        torch.manual_seed(123)
        states.append(build_model(name, shape, 10, dataset="cifar10").state_dict())
    torch.manual_seed(124)
    other = build_model(name, shape, 10, dataset="cifar10").state_dict()
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    if name != "quadratic":
        assert any(not torch.equal(states[0][k], other[k]) for k in states[0])


def test_cnn_kaiming_init_zero_bias():
    torch.manual_seed(0)
    model = build_model("cnn", (3, 32, 32), 10, dataset="cifar10")
    fc1 = next(m for m in model if isinstance(m, torch.nn.Linear))
    assert torch.count_nonzero(fc1.bias) == 0
    std = fc1.weight.std().item()
    assert abs(std - (2 / 2048) ** 0.5) < 0.05 * (2 / 2048) ** 0.5


def test_errors():
    with pytest.raises(ValueError, match="unknown model 'resnet'.*cnn, fedavg-cnn"):
        build_model("resnet", (3, 32, 32), 10)
    with pytest.raises(ValueError, match="vgg11"):
        build_model("vgg11", (1, 8, 8), 10)
    with pytest.raises(ValueError, match="image input"):
        build_model("cnn", (64,), 10)
    with pytest.raises(ValueError, match="H, W >= 4"):
        build_model("cnn", (1, 2, 2), 10)
    with pytest.raises(ValueError, match="quadratic"):
        build_model("quadratic", (3, 4), 1)


def linears(model):
    return [m for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]


@pytest.mark.parametrize(("shape", "dataset"), [((1, 28, 28), "fashion-mnist"), ((3, 32, 32), "cifar10")])
def test_official_cnn_init_leaves_the_output_layer_at_pytorch_default(shape, dataset):
    """IBM/fedau model/cnn_*.py: Kaiming for conv and fc1, fc2 left at U(±1/√fan_in) (weights, biases)."""
    torch.manual_seed(0)
    official = linears(build_model("cnn:init=official", shape, 10, dataset=dataset))
    torch.manual_seed(0)
    kaiming = linears(build_model("cnn", shape, 10, dataset=dataset))
    out = official[-1]
    bound = out.in_features ** -0.5
    w = out.weight.detach().flatten()
    assert w.abs().max() <= bound and out.bias.abs().max() <= bound and torch.count_nonzero(out.bias) == 10
    # uniform on [−b, b]: std b/√3 and half of |w| below b/2 (Kaiming: std √2·b, ~2.4x larger)
    assert abs(w.std().item() - bound / 3**0.5) < 0.05 * bound
    assert abs((w.abs() < bound / 2).float().mean().item() - 0.5) < 0.05
    assert abs(kaiming[-1].weight.std().item() - 2**0.5 * bound) < 0.1 * bound
    for m in official[:-1]:  # hidden layers: Kaiming-normal, zero bias, as with init=kaiming
        fan_in = m.weight[0].numel()
        assert torch.count_nonzero(m.bias) == 0
        assert abs(m.weight.std().item() - (2 / fan_in) ** 0.5) < 0.15 * (2 / fan_in) ** 0.5


def test_model_spec_errors_name_the_problem():
    with pytest.raises(ValueError, match="init='xavier'; choose one of kaiming, official"):
        build_model("cnn:init=xavier", (1, 28, 28), 10)
    with pytest.raises(ValueError, match=r"model 'mlp': unknown parameter\(s\) \['init'\]"):
        build_model("mlp:init=official", (1, 28, 28), 10)
