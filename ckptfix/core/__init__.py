"""Primitives every layer uses: resource limits, the device plan, atomic writes, interrupts, byte copying,
progress, units, :class:`~ckptfix.core.tensorinfo.TensorInfo` and torch's frozen tables.

May import: :mod:`ckptfix.errors` and each other. Nothing here knows a file format or a safety policy.
"""
