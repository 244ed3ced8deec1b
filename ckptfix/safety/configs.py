"""OmegaConf configs as plain data: the keys and values of a pickled ``DictConfig``/``ListConfig``.

Every Hydra project's Lightning checkpoint holds its hyper-parameters as an OmegaConf ``DictConfig``. The
unpickler reads OmegaConf's classes as inert placeholders (:data:`ckptfix.safety.allowlist.INERT_DATA`:
never imported, only their BUILD state recorded), and :func:`plain_configs` turns each container into the
data it holds: a container's state has ``_content`` (a dict of key → node, a list of nodes, or None /
``'???'`` / an interpolation string), a value node's has ``_val``; ``_metadata`` (types, flags) and
``_parent`` (a back reference) are dropped. Interpolations (``'${lr}'``) stay strings: resolving them
would run OmegaConf's resolvers. A value that is itself a placeholder (an enum of the project's) stays one.

>>> plain_configs({"hyper_parameters": <inert DictConfig>})   # doctest: +SKIP
({'hyper_parameters': {'model': {'hidden': 32}, 'lr': 0.001}}, ['omegaconf.dictconfig.DictConfig'])
"""

from __future__ import annotations

from typing import Any

from ..parse import inert
from ..parse.inert import InertObject
from .allowlist import OMEGACONF_BOXES, OMEGACONF_CONTAINERS, OMEGACONF_NODES

_CONTAINERS = frozenset(OMEGACONF_CONTAINERS)
_CONTENT = _CONTAINERS | frozenset(OMEGACONF_BOXES)  # state["_content"] is the value
_NODES = frozenset(OMEGACONF_NODES)  # state["_val"] is the value


def _config_state(x: Any) -> tuple[str, Any] | None:
    """("_content" | "_val", its value) for an OmegaConf placeholder made as pickle writes one, else None."""
    if type(x) is not InertObject or x.args or type(x.state) is not dict or x.listitems or x.dictitems:
        return None
    field = "_content" if x.name in _CONTENT else "_val" if x.name in _NODES else None
    if field is None or field not in x.state:
        return None
    return field, x.state[field]


def plain_configs(obj: Any) -> tuple[Any, list[str]]:
    """``obj`` with every OmegaConf container in it replaced by plain dicts, lists and values (in place where
    a container holds one), and the names of the classes replaced. Iterative (post-order with an explicit
    stack, as deep as the limit max_depth lets a pickle nest); shared objects converted once, cycles kept."""
    if not inert.any_made():
        return obj, []
    done: dict[int, Any] = {}
    busy: set[int] = set()
    found: set[str] = set()
    stack: list[tuple[Any, bool]] = [(obj, False)]
    while stack:
        x, expanded = stack.pop()
        if isinstance(x, (str, bytes, int, float, complex)) or x is None or id(x) in done:
            continue
        if not expanded:
            if id(x) in busy:
                continue  # a cycle: x is rebuilt when its own turn comes
            busy.add(id(x))
            stack.append((x, True))
            stack.extend((child, False) for child in _children(x))
            continue
        done[id(x)] = _rebuild(x, done, found)
    return done.get(id(obj), obj), sorted(found & _CONTAINERS)


def _children(x: Any) -> list[Any]:
    config = _config_state(x)
    if config is not None:
        value = config[1]
        return list(value.values()) if type(value) is dict else list(value) if type(value) is list else [value]
    if type(x) is InertObject:
        return [*x.args, x.state, *x.listitems, *(v for _, v in x.dictitems)]
    if isinstance(x, dict):
        return list(x.values())
    if isinstance(x, (list, tuple)):
        return list(x)
    return []  # tensors, other objects: nothing of OmegaConf's inside


def _rebuild(x: Any, done: dict[int, Any], found: set[str]) -> Any:
    def get(v: Any) -> Any:
        return done.get(id(v), v)

    config = _config_state(x)
    if config is not None:
        found.add(x.name)
        field, value = config
        if field == "_content" and type(value) is dict:
            return {k: get(v) for k, v in value.items()}
        if field == "_content" and type(value) is list:
            return [get(v) for v in value]
        return get(value)  # a node's value; a container that is None, '???' or an interpolation
    if type(x) is InertObject:
        x.args = tuple(get(v) for v in x.args)
        x.state = get(x.state)
        x.listitems = [get(v) for v in x.listitems]
        x.dictitems = [(k, get(v)) for k, v in x.dictitems]
        return x
    if isinstance(x, dict):
        for k, v in list(x.items()):
            x[k] = get(v)
        return x
    if isinstance(x, list):
        x[:] = [get(v) for v in x]
        return x
    if isinstance(x, tuple):
        items = tuple(get(v) for v in x)
        return x if all(a is b for a, b in zip(items, x)) else items
    return x
