"""A seccomp filter for the sandbox: no process inside may trace or read another's memory.

Every process of a sandbox runs as one uid, so without this a call could ``ptrace`` the
sandbox's other processes: seize a Python session's keeper (its init) so that it never
exits, or read and write the holder's memory. The filter, loaded by bubblewrap
(``--seccomp FD``) before the command starts and inherited by everything it starts, makes
these system calls fail with EPERM:

- ``ptrace``, ``process_vm_readv``, ``process_vm_writev``, ``pidfd_getfd`` (another
  process's file descriptor), ``kcmp``;
- every system call made through another ABI (32-bit ``int 0x80``, x32 numbers on
  x86_64), whose numbers differ and would pass a list of native numbers.

The program is classic BPF over ``struct seccomp_data`` (nr at offset 0, arch at 4), the
form ``prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER)`` and bubblewrap take: an array of
``struct sock_filter {u16 code; u8 jt; u8 jf; u32 k}``. Only x86_64 and aarch64 are known
here; elsewhere ``program()`` returns None and the sandbox runs without the filter (the
caller says so).
"""

from __future__ import annotations

import errno
import platform
import struct

_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
_ALLOW = 0x7FFF0000  # SECCOMP_RET_ALLOW
_DENY = 0x00050000 | errno.EPERM  # SECCOMP_RET_ERRNO | EPERM
_X32_BIT = 0x40000000

# machine: (AUDIT_ARCH_*, {name: number}, numbers at or above this are another ABI)
_ARCHES = {
    "x86_64": (0xC000003E, {"ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
                            "kcmp": 312, "pidfd_getfd": 438}, _X32_BIT),
    "aarch64": (0xC00000B7, {"ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271,
                             "kcmp": 272, "pidfd_getfd": 438}, None),
}
DENIED = ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd")


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def program(machine: str | None = None) -> bytes | None:
    """The filter for ``machine`` (this one's by default), or None where it is unknown."""
    known = _ARCHES.get(machine or platform.machine())
    if known is None:
        return None
    arch, numbers, foreign_from = known
    denied = [numbers[name] for name in DENIED]
    body = [_insn(_LD_W_ABS, 4),
            _insn(_JEQ_K, arch, jt=1),  # native: go on; else the next line denies
            _insn(_RET_K, _DENY),
            _insn(_LD_W_ABS, 0)]
    checks = ([(_JGE_K, foreign_from)] if foreign_from else []) + [(_JEQ_K, n) for n in denied]
    for i, (code, k) in enumerate(checks):
        # a match jumps over the remaining checks and the ALLOW to the DENY at the end
        body.append(_insn(code, k, jt=len(checks) - i))
    body += [_insn(_RET_K, _ALLOW), _insn(_RET_K, _DENY)]
    return b"".join(body)
