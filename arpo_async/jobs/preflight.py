"""What is checked, and made, once a run's config is read and before any process starts.

``prepare_run`` is what the entry point hands the launcher (``arpo_async.launch``, the
pipeline's RL stage, ``--dry-run``): the launcher imports only the core, so the checks that
need the tool classes or the model's tokenizer are injected from here.

- ``tools.custom``: each class imported and checked against the tool protocol
  (toolenv/tool_classes.py), one line naming ``tools.custom[i]`` and the path.
- ``model.path``: the tiny local model built there when missing (not on a dry run).
"""

from __future__ import annotations

from arpo_async.core.config import Config, ConfigError
from arpo_async.jobs.tiny_model import resolve_model_path
from toolenv.tool_classes import check_custom_tools


def prepare_run(cfg: Config, dry_run: bool = False) -> None:
    """Check ``cfg`` and resolve ``cfg.model.path``; ConfigError in one line otherwise."""
    try:
        check_custom_tools(cfg.tools)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if dry_run:
        return
    try:
        cfg.model.path = resolve_model_path(cfg)
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise ConfigError(str(exc).splitlines()[0]) from None
