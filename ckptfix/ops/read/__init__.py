"""Reading a checkpoint, a local file or a URL, into a :class:`~ckptfix.reports.Checkpoint`: ``reading`` (sniff →
read → find the state dict) and ``remote_read`` (a URL's values, each storage fetched once). The read verbs are this;
every other verb starts with it.

May import: the ``ops`` modules every verb shares (``sources``) and the layers below; no other verb's package.
"""
