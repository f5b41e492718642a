"""The private OmegaConf and Hydra names lightning_sync uses (the config schema's error messages, a sweep's jobs checked
before the first runs). See ``lightning_sync._compat``."""

from __future__ import annotations

from typing import Any

from lightning_sync._compat import TouchPoint

__all__ = ["TOUCH_POINTS", "sweep_jobs", "unresolved_value"]


def unresolved_value(node: Any, name: str) -> Any:
    """``node[name]`` as written in the config, interpolations unresolved (``${model.lr}`` stays a string)."""
    value = node._get_node(name)
    return value._value() if value is not None and hasattr(value, "_value") else value


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """The jobs Hydra's basic sweeper makes of a multirun's task ``overrides`` (``a=1,2 b=x,y``: four jobs), each
    as its list of plain overrides, in the order the sweeper runs them."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def _sweep_api_fits() -> bool:
    return sweep_jobs(["a=1,2", "b=x"]) == [["a=1", "b=x"], ["a=2", "b=x"]]


def _node_api_fits() -> bool:
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"a": 1, "b": "${a}"})
    return bool(unresolved_value(cfg, "b") == "${a}" and unresolved_value(cfg, "a") == 1)


TOUCH_POINTS: tuple[TouchPoint, ...] = (
    TouchPoint("omegaconf.DictConfig._get_node / Node._value", "config errors show the value as written",
               _node_api_fits),
    TouchPoint("hydra._internal.core_plugins.basic_sweeper.BasicSweeper.split_arguments",
               "every job of a sweep is checked before the first one runs", _sweep_api_fits),
)
