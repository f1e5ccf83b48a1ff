"""pytorch-example: A Flower / PyTorch app.

Flower's advanced-pytorch task, offline: Fashion-MNIST from its IDX files (the shared offline
copy) instead of the Hugging Face hub, and the transforms written in torch instead of torchvision
(no torchvision import on the client). The model, training, test and partitioner are Flower's.
"""

import gzip
import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from datasets import Dataset
from flwr_datasets.partitioner import DirichletPartitioner
from torch.utils.data import DataLoader

FM_NORMALIZATION = ((0.1307,), (0.3081,))
FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


class Net(nn.Module):
    """Model (simple CNN adapted for Fashion-MNIST)"""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(16, 32, 5)
        self.fc1 = nn.Linear(32 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 32 * 4 * 4)
        x = F.relu(self.fc1(x))
        return self.fc2(x)


def train(net, trainloader, epochs, lr, device):
    """Train the model on the training set."""
    net.to(device)  # move model to GPU if available
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for batch in trainloader:
            images = batch["image"]
            labels = batch["label"]
            optimizer.zero_grad()
            loss = criterion(net(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            running_loss += loss.item()

    avg_trainloss = running_loss / len(trainloader)
    return avg_trainloss


def test(net, testloader, device):
    """Validate the model on the test set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for batch in testloader:
            images = batch["image"].to(device)
            labels = batch["label"].to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    accuracy = correct / len(testloader.dataset)
    loss = loss / len(testloader)
    return loss, accuracy


def _to_tensor(img):
    """ToTensor + Normalize: 28x28 uint8 -> 1x28x28 float."""
    x = torch.as_tensor(np.asarray(img, dtype=np.float32) / 255.0).unsqueeze(0)
    return (x - FM_NORMALIZATION[0][0]) / FM_NORMALIZATION[1][0]


def _random_crop_flip(x):
    """RandomCrop(28, padding=4) + RandomHorizontalFlip, in torch."""
    i, j = (int(v) for v in torch.randint(0, 9, (2,)))
    x = F.pad(x, (4, 4, 4, 4))[:, i:i + 28, j:j + 28]
    return torch.flip(x, dims=[2]) if torch.rand(()) < 0.5 else x


def apply_train_transforms(batch):
    """Apply transforms to the partition."""
    batch["image"] = [_random_crop_flip(_to_tensor(img)) for img in batch["image"]]
    return batch


def apply_eval_transforms(batch):
    """Apply transforms to the partition."""
    batch["image"] = [_to_tensor(img) for img in batch["image"]]
    return batch


def _read_idx(path: Path) -> np.ndarray:
    """An IDX file (gzipped or not) as a numpy array."""
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    ndim = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * k:8 + 4 * k], "big") for k in range(ndim)]
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(shape)


def fashion_mnist(split: str, data_dir: str, max_examples: int) -> Dataset:
    """The first ``max_examples`` images of a Fashion-MNIST split, as a Hugging Face Dataset."""
    root = Path(data_dir) if data_dir else Path(__file__).resolve().parents[3] / "shared" / "data"
    folder = root / "fashion-mnist"
    found = []
    for name in FILES[split]:
        candidates = [folder / f"{name}.gz", folder / name]
        path = next((p for p in candidates if p.is_file()), None)
        if path is None:
            raise FileNotFoundError(f"Fashion-MNIST file {name}[.gz] not found in {folder}: set the run config "
                                    f"key data-dir to the folder that holds fashion-mnist/")
        found.append(_read_idx(path)[:max_examples])
    images, labels = found
    return Dataset.from_dict({"image": list(images), "label": labels.astype(np.int64).tolist()})


fds = None  # Cache the partitioner


def load_data(partition_id: int, num_partitions: int, data_dir: str = "", max_examples: int = 60000):
    """Load partition FashionMNIST data."""
    # Only initialize the partitioner once
    global fds
    if fds is None:
        fds = DirichletPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            alpha=1.0,
            seed=42,
        )
        fds.dataset = fashion_mnist("train", data_dir, max_examples)
    partition = fds.load_partition(partition_id)
    # Divide data on each node: 80% train, 20% test
    partition_train_test = partition.train_test_split(test_size=0.2, seed=42)

    train_partition = partition_train_test["train"].with_transform(
        apply_train_transforms
    )
    test_partition = partition_train_test["test"].with_transform(apply_eval_transforms)
    trainloader = DataLoader(train_partition, batch_size=32, shuffle=True)
    testloader = DataLoader(test_partition, batch_size=32)
    return trainloader, testloader


def create_run_dir(config: Mapping[str, Any]) -> tuple[Path, str]:
    """Create a directory where to save results from this run."""
    # Create output directory given current timestamp
    current_time = datetime.now()
    run_dir = current_time.strftime("%Y-%m-%d/%H-%M-%S-%f")
    # Save path is based on the run config's results-dir (relative: the current directory)
    save_path = Path(str(config.get("results-dir", "outputs"))).resolve() / run_dir
    save_path.mkdir(parents=True, exist_ok=False)

    # Save run config as json
    with open(f"{save_path}/run_config.json", "w", encoding="utf-8") as fp:
        json.dump(config, fp)

    return save_path, run_dir
