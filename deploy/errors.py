"""The one error of the deploy package: a deployment that cannot go on, with what to do."""


class DeployError(RuntimeError):
    pass
