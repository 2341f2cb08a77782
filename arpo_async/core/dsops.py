"""Build DeepSpeed's JIT-compiled CPU communication op once, before any learner starts.

DeepSpeed compiles its shared-memory comm op on first use (about 30 s) under a
torch ``FileBaton``: a lock file with no owner. A process killed mid-compile (Ctrl-C
during the first run) leaves that file behind and every later learner waits on it
forever. The launcher therefore builds the op itself, serialised by an ``flock`` that
all arpo_async launchers share; whoever holds the flock knows that a leftover baton is
stale and removes it. Every learner process also goes through ``prebuild_deepspeed_ops``
before DeepSpeed starts, so it never compiles outside the flock (a learner compiling
while another process "cleans up" its lock would crash).

The build folder belongs to the virtual environment (``TORCH_EXTENSIONS_DIR``, default
``sys.prefix/torch_extensions``): two checkouts with their own environments share no
build, so they never rebuild each other's op with their own include paths.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("arpo_async.core.dsops")


def extensions_dir() -> str:
    """This environment's torch extension folder (set for this process and its children)."""
    return os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))


def prebuild_deepspeed_ops() -> None:
    """Build (or load) DeepSpeed's CPU comm op under the shared flock."""
    extensions_dir()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # deepspeed, torch: heavy (the launcher imports this module); deepspeed reads
    # DS_ACCELERATOR, set just above, at import
    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import _get_build_directory

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:  # a GPU accelerator: nothing to build here
        return
    build_dir = Path(_get_build_directory(builder.NAME, False))
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir.parent / "arpo_async_build.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        baton = build_dir / "lock"
        if baton.exists():
            log.warning("removing a stale torch extension lock left by an interrupted "
                        "build: %s", baton)
            baton.unlink()
        if not any(build_dir.glob("*.so")):
            print("compiling DeepSpeed's CPU communication op (once, about 30 s)...",
                  flush=True)
        builder.load(verbose=False)
