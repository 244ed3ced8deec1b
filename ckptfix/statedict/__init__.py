"""State-dict logic on key strings, not files: wrapper prefixes (``module.``, ``_orig_mod.``), where the state
dict sits inside a training checkpoint, renames and casts, tied tensors (``ties``), repair against a target
model's keys, and the quantization schemes (``quant_schemes``: which tensors form a quantized group, how it
dequantizes).

May import: :mod:`ckptfix.core`, :mod:`ckptfix.parse`, :mod:`ckptfix.safety`, :mod:`ckptfix.errors`.
"""
