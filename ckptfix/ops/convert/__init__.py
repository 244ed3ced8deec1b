"""The convert verb's machinery: ``steps`` (validate, plan the read, normalise, write, report) and ``remote_convert``
(what a URL source converts without a local copy, and the refusal of what it can't).

May import: the ``ops`` modules every verb shares (``reading``, ``convert_options``, ``sources``) and
the layers below; not :mod:`ckptfix.ops.load_into`.
"""
