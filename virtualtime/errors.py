"""The one error of the virtual clock: a device-profile file or value that cannot be used."""

from runconfig import ConfigError


class ProfileError(ConfigError):
    """A devices file (or trace) that is missing, malformed, or names a key or value it cannot have."""
