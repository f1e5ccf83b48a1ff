"""A user's own extensions of flchurn, kept outside the project's packages (docs/extending.md)."""
