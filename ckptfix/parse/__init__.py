"""Bytes → structure, nothing executed: sniffing a format, the zip directory as torch reads it and its checks,
the safetensors header, pickle opcodes, the static pickle walker and the restricted unpickler (its machinery;
what it may build is :mod:`ckptfix.safety`'s), and where a directory checkpoint's files are.

May import: :mod:`ckptfix.core`, :mod:`ckptfix.errors`.
"""
