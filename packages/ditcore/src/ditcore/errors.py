"""Errors meant for people: what was wrong, the value seen, and what is allowed."""


class ConfigError(ValueError):
    """A configuration value is invalid. Names the key, the value seen and what is allowed."""

    def __init__(self, key: str, value, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}={value!r} is invalid: expected {allowed}")
