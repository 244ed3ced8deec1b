"""The load_into verb's machinery: ``loading`` (the plan, then the commit), ``modelwalk`` (the model read once for
the plan) and ``shards`` (DTensor shards, each rank filling its own).

May import: the ``ops`` modules every verb shares (``reading``, ``sources``) and the layers below; not
:mod:`ckptfix.ops.convert`.
"""
