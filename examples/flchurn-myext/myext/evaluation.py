"""Recipe: the server's own metrics, computed on the global model every evaluated round and
recorded in metrics.jsonl as ``test-<name>`` (and drawn in evaluation.png).

Test accuracy per class, and each client's accuracy on its own training data: their mean, the
mean of the worst ``worst`` fraction of clients and their standard deviation (the fairness
measures of q-FFL: Li et al., ICLR 2020, Sec. 5).

Reached as ``evaluation = "myext.evaluation:per_group:worst=0.25"``, or, installed,
``evaluation = "per-group:worst=0.25"``.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def per_group(model, test, train, parts, device, worst: float = 0.1) -> dict[str, float]:
    with torch.no_grad():
        right = (model(test.x.to(device)).argmax(1).cpu() == test.y).numpy()
        right_train = (model(train.x.to(device)).argmax(1).cpu() == train.y).numpy()
    labels = test.y.numpy()
    out = {f"class-accuracy-{c}": float(right[labels == c].mean()) for c in np.unique(labels)}
    per_client = np.sort([right_train[p].mean() for p in parts])
    k = max(1, math.ceil(worst * len(per_client)))
    out.update({"client-accuracy-mean": float(per_client.mean()), "client-accuracy-worst": float(per_client[:k].mean()),
                "client-accuracy-std": float(per_client.std())})
    return out
