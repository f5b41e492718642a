"""The private OmegaConf names lightning_sync uses (the config schema's error messages). See ``lightning_sync._compat``."""

from __future__ import annotations

from typing import Any

from lightning_sync._compat import TouchPoint

__all__ = ["TOUCH_POINTS", "unresolved_value"]


def unresolved_value(node: Any, name: str) -> Any:
    """``node[name]`` as written in the config, interpolations unresolved (``${model.lr}`` stays a string)."""
    value = node._get_node(name)
    return value._value() if value is not None and hasattr(value, "_value") else value


def _node_api_fits() -> bool:
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"a": 1, "b": "${a}"})
    return bool(unresolved_value(cfg, "b") == "${a}" and unresolved_value(cfg, "a") == 1)


TOUCH_POINTS: tuple[TouchPoint, ...] = (
    TouchPoint("omegaconf.DictConfig._get_node / Node._value", "config errors show the value as written",
               _node_api_fits),
)
