"""The library's operations on checkpoints, one package per verb with machinery of its own: ``convert`` and
``load_into``, which import no other verb's package. What verbs share sits at this level: ``reading`` (a checkpoint,
file or URL, read into a Checkpoint: what read, inspect and describe return, and every verb's first step) with
``remote_read`` (a URL's values), ``sources``, ``convert_options``; ``api`` defines the public verbs over them all,
``diff`` is one module.

May import: every layer below (core, parse, safety, statedict, formats) and the top-level ``errors``,
``reports`` and ``text``.
"""
