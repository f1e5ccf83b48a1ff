"""Recipe: a study as Python (the same study as study.toml): 3 rules x 2 seeds on the user's data."""

from experiments.study import Sweep

STUDY = Sweep(
    name="myext-compare",
    base={"dataset": "myext.data:blobs:n=400,noise=4.0", "model": "myext.nets:tiny_mlp:width=16",
          "partition": "myext.splits:FeatureSkew", "availability": "myext.schedules:Diurnal:period=6",
          "num-clients": 6, "num-server-rounds": 4, "local-steps": "steps:n=2", "batch-size": 16,
          "lr": 0.1, "eval-every": 2, "checkpoint-every": 0, "engine": "per-client", "device": "cpu"},
    axes={"rule": {"fedavg": {"strategy": "fedavg-active"}, "mifa": {"strategy": "mifa"},
                   "fedau": {"strategy": "fedau"}}},
    seeds=(0, 1),
    notes="Three rules on the user's blobs, feature-skewed, with diurnal availability.",
)
