"""secaggexample: A Flower with SecAgg+ app."""
