"""The task and tool sections: ``task`` (prompt source) and ``tools``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from arpo_async.core.config.base import _Section


class TaskConfig(_Section):
    name: Literal["arith", "synthetic_tools", "file"] = Field(
        "arith",
        description="prompt source: built-in arithmetic, synthetic tool suite, or data file"
    )
    data: str = Field("", description="JSONL/parquet file when task.name=file")
    on_bad_row: Literal["raise", "skip"] = Field(
        "raise", description="a data row without question or answer: stop, or log and skip it"
    )
    seed: int = Field(0, description="seed of the generated task")
    num_prompts: int = Field(2000, description="prompts generated for built-in tasks")


class ToolsConfig(_Section):
    enabled: list[str] = Field(default_factory=list, description="tools offered: python, search")
    custom: list[str] = Field(
        default_factory=list, description="your own tools, offered too: module:Class import "
        "paths of classes following the tool protocol (toolenv/base.py, docs/tools.md)")
    syntax: Literal["arpo", "hermes"] = Field(
        "arpo", description="tool-call format: arpo tags (<python>code</python>, results in "
        "<result>), or hermes (<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>, "
        "results as the chat template's tool message, schemas via its tools= argument)")
    cache_dir: str = Field(
        "", description="shared tool-result cache folder ('' = run_dir/tool_cache)")
    cache_ttl_s: float = Field(0.0, description="tool cache entry lifetime (0: forever)")
    rate_per_s: float = Field(100.0, description="tool calls per second per actor")
    concurrency: int = Field(16, ge=1, description="tool calls in flight per actor")
    timeout_s: float = Field(10.0, description="wall-clock limit per tool call")
    retries: int = Field(2, ge=0, description="retries of a transient tool error")
    python_cpu_s: int = Field(5, description="sandbox CPU-time limit, seconds")
    python_memory_mb: int = Field(512, description="sandbox address-space limit, MiB")
    python_max_procs: int = Field(32, description="sandbox process limit")
    python_max_output: int = Field(4096, description="characters of tool output kept")
    allow_unsandboxed: bool = Field(False, description="run Python without bubblewrap (unsafe)")
    python_pool: int = Field(
        2, ge=0, description="warm Python sandboxes kept ready per actor, count (0: a cold "
        "sandbox per call); each holds one idle interpreter (~20 MiB RSS with math) and a uid")
    python_preload: list[str] = Field(
        default_factory=lambda: ["math"], description="modules each warm sandbox imports "
        "before its call, names (numpy ~0.1, sympy ~0.25 CPU-s per call, used or not)")
    retriever_url: str = Field("", description="retriever endpoint (POST /retrieve)")
    search_topk: int = Field(3, description="snippets per search")
    search_snippet_chars: int = Field(200, description="characters kept per snippet")

    @field_validator("custom")
    @classmethod
    def _import_paths(cls, paths: list[str]) -> list[str]:
        # Only the form here: the classes are imported and checked where the run is
        # resolved (toolenv/tool_classes.py), not while a config is read.
        for i, path in enumerate(paths):
            module, sep, attr = path.partition(":")
            if not (sep and module and attr):
                raise ValueError(f"tools.custom[{i}]={path}: expected module:Class")
        return paths

    @property
    def offered(self) -> bool:
        """Any tool offered (built-in or custom)?"""
        return bool(self.enabled or self.custom)
