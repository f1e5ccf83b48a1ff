"""pytorchexample: A Flower / PyTorch app.

Flower's template task (`flwr new`, quickstart-pytorch), offline: CIFAR-10 from the shared JPEG
copy (the first ``max-examples`` training images, and as many test images over 5) instead of the
Hugging Face hub; the model, transforms, training and test are Flower's.
"""

import io
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from datasets import Dataset, Features, Value
from datasets import Image as ImageFeature
from flwr_datasets.partitioner import IidPartitioner
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.transforms import Compose, Normalize, ToTensor


class Net(nn.Module):
    """Model (simple CNN adapted from 'PyTorch: A 60 Minute Blitz')"""

    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


fds = None  # Cache the partitioner
CIFAR10 = Path("cifar10") / "cifar10-jpeg-q75.npz"  # offline copy: every image JPEG-encoded (quality 75)


def cifar10(split: str, data_dir: str, max_examples: int) -> Dataset:
    """The first ``max_examples`` images of a split of the offline CIFAR-10 copy, as the hub's Dataset."""
    root = Path(data_dir) if data_dir else Path(__file__).resolve().parents[3] / "shared" / "data"
    path = root / CIFAR10
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: set the run config key data-dir to the folder that holds "
                                f"{CIFAR10}")
    with np.load(path) as npz:
        data, offsets, labels = npz[f"{split}_jpeg"], npz[f"{split}_offsets"], npz[f"{split}_labels"]
        n = min(int(max_examples), len(labels))
        images = [Image.open(io.BytesIO(data[offsets[i]:offsets[i + 1]].tobytes())).convert("RGB") for i in range(n)]
    return Dataset.from_dict({"img": images, "label": labels[:n].astype(np.int64).tolist()},
                             features=Features({"img": ImageFeature(), "label": Value("int64")}))


pytorch_transforms = Compose([ToTensor(), Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])


def apply_transforms(batch):
    """Apply transforms to the partition from FederatedDataset."""
    batch["img"] = [pytorch_transforms(img) for img in batch["img"]]
    return batch


def load_data(partition_id: int, num_partitions: int, batch_size: int, data_dir: str = "",
              max_examples: int = 50000):
    """Load partition CIFAR10 data."""
    # Only initialize the partitioner once
    global fds
    if fds is None:
        fds = IidPartitioner(num_partitions=num_partitions)
        fds.dataset = cifar10("train", data_dir, max_examples)
    partition = fds.load_partition(partition_id)
    # Divide data on each node: 80% train, 20% test
    partition_train_test = partition.train_test_split(test_size=0.2, seed=42)
    # Construct dataloaders
    partition_train_test = partition_train_test.with_transform(apply_transforms)
    trainloader = DataLoader(
        partition_train_test["train"], batch_size=batch_size, shuffle=True
    )
    testloader = DataLoader(partition_train_test["test"], batch_size=batch_size)
    return trainloader, testloader


def load_centralized_dataset(data_dir: str = "", max_examples: int = 50000):
    """Load test set and return dataloader."""
    # Load the test set (the first max_examples / 5 images: 10000 of the full copy)
    test_dataset = cifar10("test", data_dir, max_examples // 5)
    dataset = test_dataset.with_format("torch").with_transform(apply_transforms)
    return DataLoader(dataset, batch_size=128)


def train(net, trainloader, epochs, lr, device):
    """Train the model on the training set."""
    net.to(device)  # move model to GPU if available
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for batch in trainloader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    avg_trainloss = running_loss / (epochs * len(trainloader))
    return avg_trainloss


def test(net, testloader, device):
    """Validate the model on the test set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for batch in testloader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    accuracy = correct / len(testloader.dataset)
    loss = loss / len(testloader)
    return loss, accuracy
