"""The base of every config section, the one error type of configs, and tagged unions:
a section whose keys depend on one of its values (``learner.loss.type``,
``tools.python.state``), one class per value."""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


class ConfigError(ValueError):
    """A config problem, stated in one line that names the key or path."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Tagged:
    """A section that is one of several classes, chosen by its ``tag`` key (prime-rl's
    ``Field(discriminator=...)``): ``members`` maps each tag value to its class, whose
    ``tag`` field is a ``Literal`` of that value; ``default`` is the value when the key is
    left out. ``where`` is the section's dotted path and ``noun`` what a tag value is
    called, for errors. ``annotation`` is the field's type: it validates through
    ``section`` first, so a field declared with it needs no validator of its own."""

    def __init__(self, where: str, tag: str, members: dict[str, type[_Section]], default: str,
                 noun: str):
        self.where, self.tag, self.members, self.default = where, tag, members, default
        self.noun = noun
        self.annotation = Annotated[Union[tuple(members.values())],  # noqa: UP007
                                    Field(discriminator=tag), BeforeValidator(self.section)]

    def section(self, raw: Any) -> Any:
        """The raw mapping with its tag (the default when left out; a bare tag value stands
        for that member with its defaults); a key of another member is refused naming both,
        an unknown tag naming the known ones."""
        if isinstance(raw, (str, bool)):
            raw = {self.tag: raw}
        if not isinstance(raw, dict):
            return raw
        kind = raw.get(self.tag, self.default)
        if kind is False and "off" in self.members:
            kind = "off"  # YAML 1.1 reads a bare `off` as false
        cls = self.members.get(kind)
        if cls is None:
            raise ValueError(f"{self.where}.{self.tag}: {kind!r} is not a {self.noun} "
                             f"({', '.join(sorted(self.members))})")
        for key in raw:
            if key not in cls.model_fields:
                owners = sorted(t for t, c in self.members.items() if key in c.model_fields)
                if owners:
                    raise ValueError(f"{self.where}.{key}: a key of {self.noun} "
                                     f"{', '.join(owners)}, not of {kind}")
        return {**raw, self.tag: kind}

    def retag(self, raw: dict[str, Any], kind: str) -> dict[str, Any]:
        """The raw section as member ``kind``: its tag set, the keys ``kind`` does not have
        dropped (an AEPO run's rollout evaluated as GRPO)."""
        fields = self.members[kind].model_fields
        return {**{k: v for k, v in raw.items() if k in fields}, self.tag: kind}
