"""pytorch-example: A Flower / PyTorch app."""
