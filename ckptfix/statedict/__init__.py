"""State-dict logic on key strings, not files: wrapper prefixes (``module.``, ``_orig_mod.``), where the state
dict sits inside a training checkpoint, renames and casts, tied tensors (``ties``), and repair against a target
model's keys.

May import: :mod:`ckptfix.core`, :mod:`ckptfix.parse`, :mod:`ckptfix.safety`, :mod:`ckptfix.errors`.
"""
