"""DeepSpeed ZeRO checkpoints (stages 1–3): where each fp32 master weight sits (``partitions``,
zero_to_fp32.py's rules as data) and the consolidation itself (``consolidate``).

May import: the layers below :mod:`ckptfix.formats` and the ``formats`` package itself.
"""
