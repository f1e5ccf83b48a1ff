"""Flower's FedAvg around the project's workload (benchmarks/ray_path.py's baseline)."""
