"""Load benchmark and RL prompt sets (JSONL or parquet) into one ``Example`` shape.

The public sets name their fields differently: ``question`` or ``problem``; an answer
that is a string, a list of accepted strings, a number, or GSM8K's worked solution
ending in ``#### N``; and the ARPO RL parquet schema (a chat ``prompt`` list with the
system prompt, ``ability``, ``reward_model.ground_truth``). Each shape is mapped
explicitly, and a row that cannot be used raises ``DataError`` naming the file and its
1-based row number (the line number for JSONL).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from arpo_async.core.files import iter_jsonl

log = logging.getLogger(__name__)

KINDS = ("math", "qa")
# File-name hints for the kind of a set, checked in order (first match wins).
_NAME_HINTS = (
    ("math", ("gsm8k", "math", "aime", "amc", "olympiad")),
    ("qa", ("hotpot", "bamboogle", "musique", "2wiki", "nq", "triviaqa", "popqa", "qa")),
)
_ABILITY_KIND = {"math": "math", "qa": "qa"}
_GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)


class DataError(ValueError):
    """A data file or row that cannot be used; the message names the file and row."""


@dataclass
class Example:
    id: str
    question: str
    answers: list[str]
    kind: str  # "math" | "qa"
    source: str = ""
    system_prompt: str | None = None
    meta: dict = field(default_factory=dict)
    row: int = 0  # 1-based row of the file (the line number for JSONL)


def load_examples(
    path: str | Path,
    kind: str | None = None,
    limit: int | None = None,
    on_bad_row: Literal["raise", "skip"] = "raise",
) -> list[Example]:
    """Read up to ``limit`` examples from a ``.jsonl`` or ``.parquet`` file.

    ``kind`` ("math" or "qa") overrides what the rows or the file name say. With
    ``on_bad_row="skip"`` a row without a question or answer is logged and dropped
    instead of raising (the ARPO train set has one such row)."""
    path = Path(path)
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if on_bad_row not in ("raise", "skip"):
        raise ValueError(f"on_bad_row must be 'raise' or 'skip', got {on_bad_row!r}")
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    name_kind = _kind_from_name(path.name)
    out: list[Example] = []
    skipped = 0
    for n, row in _read_rows(path):
        try:
            out.append(_to_example(row, n, path, kind, name_kind))
        except DataError as err:
            if on_bad_row == "raise":
                raise
            skipped += 1
            log.warning("skipping %s", err)
        if limit is not None and len(out) >= limit:
            break
    if skipped:
        log.warning("%s: skipped %d unusable rows", path, skipped)
    return out


def _kind_from_name(name: str) -> str | None:
    low = name.lower()
    for kind, hints in _NAME_HINTS:
        if any(h in low for h in hints):
            return kind
    return None


def _read_rows(path: Path) -> Iterator[tuple[int, dict]]:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        yield from iter_jsonl(path, DataError)
    elif suffix == ".parquet":
        yield from _read_parquet(path)
    else:
        raise DataError(f"{path}: unsupported file type {suffix!r} (expected .jsonl or .parquet)")


def _read_parquet(path: Path) -> Iterator[tuple[int, dict]]:
    import pyarrow.parquet as pq  # lazy: only parquet readers pay for it

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001 (pyarrow raises several types)
        raise DataError(f"{path}: not a readable parquet file: {exc}") from None
    n = 0
    for batch in pf.iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            n += 1
            yield n, row


def _to_example(
    row: dict, n: int, path: Path, kind: str | None, name_kind: str | None
) -> Example:
    where = f"{path}: row {n}"
    if isinstance(row.get("prompt"), list):
        question, system, meta = _from_chat_prompt(row, where)
    else:
        question = _first(row, ("question", "problem"))
        system, meta = None, {}
    if not isinstance(question, str) or not question.strip():
        raise DataError(f"{where}: no question (expected a non-empty 'question' or 'problem')")
    answers = _answers(row, where)
    kind = kind or _row_kind(row, where) or name_kind
    if kind is None:
        raise DataError(f"{where}: cannot tell math from qa; pass kind='math' or kind='qa'")
    source = str(row.get("data_source") or path.stem)
    return Example(
        id=f"{path.stem}:{_row_id(row, n)}",
        question=question,
        answers=answers,
        kind=kind,
        source=source,
        system_prompt=system,
        meta=meta,
        row=n,
    )


def _from_chat_prompt(row: dict, where: str) -> tuple[Any, str | None, dict]:
    """ARPO RL schema: system + user messages. The user message holds the bare question
    (in the ARPO sets it equals extra_info.question), so the chat template wraps it."""
    system, user = None, None
    for msg in row["prompt"]:
        if not isinstance(msg, dict):
            raise DataError(f"{where}: prompt entries must be {{role, content}} objects")
        if msg.get("role") == "system" and system is None:
            system = msg.get("content")
        elif msg.get("role") == "user":
            user = msg.get("content")
    extra = row.get("extra_info") or {}
    question = user if user else extra.get("question")
    meta: dict = {k: extra[k] for k in ("index", "split") if k in extra}
    if isinstance(system, str) and "\x08oxed" in system:
        # The published ARPO prompt wrote "\boxed" in a non-raw Python string, so "\b"
        # became a backspace; restore the LaTeX command the model is meant to write.
        system = system.replace("\x08oxed", "\\boxed")
        meta["repaired_system_prompt"] = True
    return question, system, meta


def _first(row: dict, keys: tuple[str, ...]) -> Any:
    for key in keys:
        if row.get(key) is not None:
            return row[key]
    return None


def _answers(row: dict, where: str) -> list[str]:
    raw = _first(row, ("answer", "answers", "golden_answers"))
    if raw is None and isinstance(row.get("reward_model"), dict):
        raw = row["reward_model"].get("ground_truth")
    if isinstance(raw, dict) and "target" in raw:  # Search-R1 style {"target": [...]}
        raw = raw["target"]
    if isinstance(raw, bool):
        raise DataError(f"{where}: answer must be a string, list or number, got a bool")
    if isinstance(raw, (int, float)):
        raw = [_number_text(raw)]
    elif isinstance(raw, str):
        raw = [_gsm8k_final(raw, where) if "####" in raw else raw]
    elif isinstance(raw, (list, tuple)):
        raw = [_number_text(a) if isinstance(a, (int, float)) else a for a in raw]
    elif raw is not None:
        raise DataError(f"{where}: answer has unsupported type {type(raw).__name__}")
    answers = [a.strip() for a in raw or [] if isinstance(a, str) and a.strip()]
    if not answers:
        raise DataError(f"{where}: no answer (expected a non-empty 'answer' or ground_truth)")
    return answers


def _gsm8k_final(text: str, where: str) -> str:
    m = _GSM8K_FINAL.search(text)
    final = m.group(1).replace(",", "").strip() if m else ""
    if not final:
        raise DataError(f"{where}: '####' is not followed by a final answer")
    return final


def _number_text(x: float) -> str:
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    return str(x)


def _row_kind(row: dict, where: str) -> str | None:
    ability = row.get("ability")
    if ability is None:
        return None
    kind = _ABILITY_KIND.get(str(ability).lower())
    if kind is None:
        raise DataError(f"{where}: ability {ability!r} is not one of {sorted(_ABILITY_KIND)}")
    return kind


def _row_id(row: dict, n: int) -> str:
    for key in ("id", "idx"):
        if row.get(key) is not None:
            return str(row[key])
    extra = row.get("extra_info")
    if isinstance(extra, dict) and extra.get("index") is not None:
        return str(extra["index"])
    return str(n - 1)
