"""The base of every config section, and the one error type of configs."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

class ConfigError(ValueError):
    """A config problem, stated in one line that names the key or path."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
