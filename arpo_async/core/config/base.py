"""The base of every config section, the one error type of configs, and tagged unions:
a section whose keys depend on one of its values (``learner.loss.type``,
``tools.python.state``), one class per value."""

from __future__ import annotations

import inspect
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

    def kind(self, raw: dict[str, Any]) -> Any:
        """The tag value of a raw section (the default when left out)."""
        kind = raw.get(self.tag, self.default)
        if kind is False and "off" in self.members:
            kind = "off"  # YAML 1.1 reads a bare `off` as false
        return kind

    def section(self, raw: Any) -> Any:
        """The raw mapping with its tag (the default when left out; a bare tag value stands
        for that member with its defaults); a key of another member is refused naming both,
        an unknown tag naming the known ones."""
        if isinstance(raw, (str, bool)):
            raw = {self.tag: raw}
        if not isinstance(raw, dict):
            return raw
        kind = self.kind(raw)
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

    def shared(self, old: str, new: str) -> set[str]:
        """The keys that mean the same in members ``old`` and ``new``: those both inherit
        from the one class that declares them (``_LossBase.kl_coef``). A key a member
        declares itself is its own, even where another member has one of the same name
        (``learner.loss.eps_low``: a token ratio clip in ppo, a sequence ratio clip in gspo,
        an IS-weight clip in cispo). An unknown ``old`` shares what every member shares."""
        olds = ([self.members[old]] if isinstance(old, str) and old in self.members
                else list(self.members.values()))
        cls = self.members[new]
        return {key for key in cls.model_fields if key != self.tag
                and all(key in o.model_fields and _declarer(o, key) is _declarer(cls, key)
                        for o in olds)}

    def retag(self, raw: dict[str, Any], kind: str) -> dict[str, Any]:
        """The raw section as member ``kind``: its tag set, the keys it shares with the
        section's member kept (``shared``), every other key dropped, so that a key whose
        meaning differs starts at the new member's default (an AEPO run's rollout evaluated
        as GRPO keeps ARPO's keys; a PPO preset run as GSPO gets GSPO's clip, not PPO's)."""
        keep = self.shared(self.kind(raw), kind)
        return {**{k: v for k, v in raw.items() if k in keep}, self.tag: kind}


def _declarer(cls: type, key: str) -> type:
    """The class in ``cls``'s bases whose own body declares field ``key``."""
    return next(c for c in cls.__mro__ if key in inspect.get_annotations(c))
