"""The step encoding of the delta weight channel (delta.py): what changed between two
versions of the weights, per tensor the smallest of four encodings (``step``), written
back into a copy (``apply_step``), and the checksums that check the result. Pure: torch,
numpy, zstandard and xxhash, no sockets."""

from __future__ import annotations

import numpy as np


def checksum(t) -> int:
    """xxh3-64 of a tensor's bytes (about 15 GB/s here)."""
    import xxhash

    return xxhash.xxh3_64_intdigest(_bytes(t))


def digest(checksums: dict[str, int]) -> int:
    """One number for a whole state: a hash of every tensor's name and checksum."""
    import xxhash

    return xxhash.xxh3_64_intdigest(
        "".join(f"{k}:{checksums[k]};" for k in sorted(checksums)).encode())


def _bytes(t) -> np.ndarray:
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def bits(t):
    """The tensor's values as integers of the same width: equal bits, equal integers."""
    import torch

    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.reshape(-1).view(width)


def step(old: dict, new: dict) -> dict[str, dict]:
    """Per tensor of ``new`` whose bits differ from ``old``'s, the smallest encoding, as
    the message fields it fills (``DeltaUpdate``) and ``changed``, the values changed:

    - ``diff`` (2-byte dtypes): each value's bit pattern minus the old one's, as int8,
      zstd-compressed; a training step moves a bf16 value by a few units in the last
      place, so these are small numbers, mostly 0 and +-1, that compress well. Values
      whose difference does not fit int8 (a sign that flipped) go as positions + values;
    - ``index``: the changed positions as int32, with the new values;
    - ``mask``: the changed positions as a packed bitmask, with the new values;
    - ``dense``: the whole tensor."""
    out = {}
    for name, t in new.items():
        flat = t.reshape(-1)
        size, n = t.element_size(), flat.numel()
        if size == 2:  # int16 arithmetic wraps: old + diff == new, modulo 2**16, always
            diff = bits(t) - bits(old[name])
            changed = diff != 0
        else:
            diff, changed = None, bits(old[name]) != bits(t)
        count = int(changed.sum())
        if count == 0:
            continue
        options = [({"dense": t}, n * size),
                   ({"index": None}, count * (_position_bytes(n) + size)),
                   ({"mask": None}, (n + 7) // 8 + count * size)]
        if diff is not None:
            options.append(_diff(diff, flat))
        parts, _ = min(options, key=lambda o: o[1])
        if "index" in parts and parts["index"] is None:
            parts = _positions(changed, flat, "index")
        elif "mask" in parts:
            parts = _positions(changed, flat, "mask")
        out[name] = parts | {"changed": count}
    return out


def _positions(changed, flat, kind: str) -> dict:
    import torch

    if kind == "index":
        dtype = torch.int32 if _position_bytes(flat.numel()) == 4 else torch.int64
        where = changed.nonzero().reshape(-1).to(dtype)
    else:
        where = torch.from_numpy(np.packbits(changed.numpy()))
    return {kind: where, "values": flat[changed].clone()}


def _position_bytes(n: int) -> int:
    """Bytes of one position in a tensor of ``n`` values (int64 from 2**31 values)."""
    return 4 if n < 2**31 else 8


def _diff(diff, flat) -> tuple[dict, int]:
    """The ``diff`` encoding of one 2-byte tensor (``diff``: its int16 bit differences,
    ``flat``: its new values) and its size in bytes."""
    import torch
    import zstandard

    far = (diff > 127) | (diff < -128)
    small = diff.to(torch.int8)
    small[far] = 0
    # all cores for a large tensor (the output is one zstd frame either way)
    threads = -1 if small.numel() > 1 << 24 else 0
    blob = zstandard.ZstdCompressor(level=1, threads=threads).compress(small.numpy().data)
    parts = {"diff": torch.frombuffer(bytearray(blob), dtype=torch.uint8)}
    size = len(blob)
    if bool(far.any()):
        parts |= _positions(far, flat, "index")
        size += int(far.sum()) * (_position_bytes(flat.numel()) + flat.element_size())
    return parts, size


def apply_step(base: dict, update) -> list[str]:
    """Write ``update``'s parts (a ``DeltaUpdate``'s tensor fields) into ``base``
    (writable tensors, changed in place); the names written. Whole tensors and positions
    with values overwrite (applying them again changes nothing); a diff adds to the bit
    patterns, so a step must be applied to its own base exactly once (the receiver checks
    the base's version and digest). Raises
    ValueError on a part that does not fit its tensor."""
    import torch

    names = []
    for name, t in update.dense.items():
        _fits(base, name, t.dtype, t.numel())
        base[name].copy_(t.reshape(base[name].shape))
        names.append(name)
    for name, blob in update.diff.items():
        _fits(base, name, None, None)
        pattern = bits(base[name])
        d = _unzstd(blob, pattern.numel())
        pattern += torch.from_numpy(d.astype(np.int16))
        names.append(name)
    for name, values in update.values.items():
        _fits(base, name, values.dtype, None)
        flat = base[name].reshape(-1)
        if name in update.index:
            where = update.index[name].to(torch.int64)
            if where.numel() != values.numel() or (
                    where.numel() and (int(where.min()) < 0 or int(where.max()) >= flat.numel())):
                raise ValueError(f"{name}: positions outside the tensor")
        elif name in update.mask:
            packed = np.unpackbits(update.mask[name].numpy(), count=flat.numel())
            where = torch.from_numpy(packed.view(bool))
            if int(where.sum()) != values.numel():
                raise ValueError(f"{name}: {values.numel()} values for {int(where.sum())} "
                                 "positions")
        else:
            raise ValueError(f"{name}: values without positions")
        flat[where] = values
        names.append(name)
    return list(dict.fromkeys(names))  # a diff's far values also come as positions


def _unzstd(blob, count: int) -> np.ndarray:
    import zstandard

    try:
        raw = zstandard.ZstdDecompressor().decompress(blob.numpy().tobytes(),
                                                      max_output_size=count)
    except zstandard.ZstdError as exc:
        raise ValueError(f"diff: {exc}") from None
    if len(raw) != count:
        raise ValueError(f"diff: {len(raw)} differences for {count} values")
    return np.frombuffer(raw, dtype=np.int8)


def _fits(base: dict, name: str, dtype, numel: int | None) -> None:
    if name not in base:
        raise ValueError(f"{name}: not a tensor of this model")
    if dtype is None:  # a diff: of the bit patterns of a 2-byte dtype
        if base[name].element_size() != 2:
            raise ValueError(f"{name}: a diff for a {base[name].dtype} tensor")
        return
    if base[name].dtype != dtype or (numel is not None and base[name].numel() != numel):
        raise ValueError(f"{name}: {dtype} x {numel} does not fit {base[name].dtype} "
                         f"{tuple(base[name].shape)}")
