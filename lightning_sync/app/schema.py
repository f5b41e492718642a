"""The schema of ``lsync-train``'s config, checked before any process starts (``config.check_config``).

Every node of the composed config that has a ``_target_`` is checked against what it builds: the
target must import, each key must be an argument of its constructor (or function), and each value
must have the argument's annotated type (``Union``, ``Optional``, ``Literal``, ``list[...]`` and
nested ``_target_`` nodes included). Ranges come from the dataclasses below, one per config group
the job owns (``seed``/``validate_after_fit``, ``trainer``, ``model``, ``data``); a field's metadata
holds its rule. Values set by interpolation (``${seed}``) are checked where they are defined.

A problem is reported as :class:`Problem` (key, value, why, fix); ``config.check_config`` turns the
first one into the ``config error`` line.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import importlib.util
import inspect
import re
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_sync._compat.omegaconf_api import unresolved_value

__all__ = ["DigitsCNNConfig", "DigitsDataConfig", "JobConfig", "Problem", "TrainerConfig", "import_problem",
           "problems"]

#: Where ``pip install`` works from: a clone of the repository (lightning_sync is not on an index).
INSTALL_FROM_CLONE = "pip install -c constraints.txt \".[recipes]\" (in the lightning_sync repository)"
_HYDRA_KEYS = {"_target_", "_partial_", "_convert_", "_recursive_", "_args_"}


@dataclass(frozen=True)
class Problem:
    """A config value that cannot work: ``key=value: why. Fix: fix``."""

    key: str
    value: Any
    why: str
    fix: str

    def __str__(self) -> str:
        return f"{self.key}={self.value}: {self.why}. Fix: {self.fix}"


@dataclass(frozen=True)
class Rule:
    """A range: ``ok(value)`` must hold for any value of the right type (None is checked by type)."""

    ok: Callable[[Any], bool]
    why: str


def rule(ok: Callable[[Any], bool], why: str) -> dict[str, Rule]:
    return {"rule": Rule(ok, why)}


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def at_least(low: float) -> dict[str, Rule]:
    return rule(lambda v: not _num(v) or v >= low, f"must be >= {low}")


def above(low: float) -> dict[str, Rule]:
    return rule(lambda v: not _num(v) or v > low, f"must be > {low}")


def in_range(low: float, high: float, closed: str = "[)") -> dict[str, Rule]:
    def ok(v: Any) -> bool:
        if not _num(v):
            return True
        return bool((v >= low if closed[0] == "[" else v > low) and (v <= high if closed[1] == "]" else v < high))

    return rule(ok, f"must be in {closed[0]}{low}, {high}{closed[1]}")


_DURATION = re.compile(r"^\d+:\d{1,2}:\d{1,2}:\d{1,2}$")


def _batches(v: Any) -> bool:  # limit_*_batches / overfit_batches: a fraction in [0, 1] or a count
    return not _num(v) or (isinstance(v, int) and v >= 0) or (isinstance(v, float) and 0.0 <= v <= 1.0)


# ------------------------------------------------------------------------- the job's own groups

@dataclass
class JobConfig:
    """Top-level keys of ``conf/train.yaml``."""

    seed: int = field(default=1234, metadata=in_range(0, 2**32 - 1, "[]"))  # seed_everything's range
    run_dir: str = "${hydra:runtime.output_dir}"
    validate_after_fit: bool = False


@dataclass
class TrainerConfig:
    """Ranges of the ``lightning.pytorch.Trainer`` arguments the ``trainer`` group sets (types come
    from ``Trainer.__init__``'s annotations)."""

    devices: Any = field(default=2, metadata=rule(
        lambda v: v == "auto" or v == -1 or (isinstance(v, int) and v >= 1) or isinstance(v, (list, ListConfig))
        or (isinstance(v, str) and re.fullmatch(r"\d+(,\d+)*,?", v) is not None),
        "must be a number of processes >= 1, a list of device ids, or auto"))
    num_nodes: int = field(default=1, metadata=at_least(1))
    max_epochs: int | None = field(default=12, metadata=rule(
        lambda v: not _num(v) or v >= -1, "must be >= 1, or -1 to train until max_steps/max_time or Ctrl-C"))
    min_epochs: int | None = field(default=None, metadata=at_least(0))
    max_steps: int = field(default=-1, metadata=rule(lambda v: not _num(v) or v >= -1, "must be >= 1, or -1 (no limit)"))
    max_time: str | None = field(default=None, metadata=rule(
        lambda v: not isinstance(v, str) or _DURATION.match(v) is not None, "must be DD:HH:MM:SS, e.g. 00:00:10:00"))
    log_every_n_steps: int = field(default=10, metadata=at_least(1))
    limit_train_batches: float = field(default=1.0, metadata=rule(_batches, "must be a fraction in [0, 1] or a count >= 0"))
    limit_val_batches: float = field(default=1.0, metadata=rule(_batches, "must be a fraction in [0, 1] or a count >= 0"))
    overfit_batches: float = field(default=0.0, metadata=rule(_batches, "must be a fraction in [0, 1] or a count >= 0"))
    num_sanity_val_steps: int = field(default=0, metadata=at_least(-1))
    check_val_every_n_epoch: int | None = field(default=1, metadata=at_least(1))
    accumulate_grad_batches: int = field(default=1, metadata=at_least(1))
    gradient_clip_val: float | None = field(default=None, metadata=at_least(0))
    fast_dev_run: int = field(default=0, metadata=at_least(0))


@dataclass
class DigitsCNNConfig:
    """``model`` group: ``lightning_sync.app.models.DigitsCNN``."""

    channels: int = field(default=32, metadata=at_least(1))
    num_classes: int = field(default=10, metadata=at_least(2))
    lr: float = field(default=0.1, metadata=above(0))
    momentum: float = field(default=0.9, metadata=in_range(0, 1))
    weight_decay: float = field(default=5e-4, metadata=at_least(0))
    dropout: float = field(default=0.1, metadata=in_range(0, 1))


@dataclass
class DigitsDataConfig:
    """``data`` group: ``lightning_sync.app.data.DigitsDataModule``."""

    batch_size: int = field(default=32, metadata=at_least(1))
    val_fraction: float = field(default=0.2, metadata=in_range(0, 1, "()"))
    split_seed: int = field(default=0, metadata=in_range(0, 2**63 - 1, "[]"))
    num_workers: int = field(default=0, metadata=at_least(0))


#: ``_target_`` -> the dataclass holding its ranges.
SCHEMAS: dict[str, type] = {
    "lightning.pytorch.Trainer": TrainerConfig,
    "lightning.Trainer": TrainerConfig,
    "lightning.pytorch.trainer.trainer.Trainer": TrainerConfig,
    "lightning_sync.app.models.DigitsCNN": DigitsCNNConfig,
    "lightning_sync.app.data.DigitsDataModule": DigitsDataConfig,
    "lightning_sync.models.DigitsCNN": DigitsCNNConfig,  # the old module names (a config written before the move)
    "lightning_sync.data.DigitsDataModule": DigitsDataConfig,
}

#: Targets that import without an optional package but fail when built: ``_target_`` suffix ->
#: (any of these modules, the package to install).
OPTIONAL_PACKAGES: dict[str, tuple[tuple[str, ...], str]] = {
    "TensorBoardLogger": (("tensorboard", "tensorboardX"), "tensorboard"),
}
#: Top-level modules of a ``_target_`` -> the package that provides them.
PACKAGES = {"hydra_plugins": "hydra-submitit-launcher", "tensorboard": "tensorboard", "sklearn": "scikit-learn"}


# --------------------------------------------------------------------------------- type checks

def type_name(tp: Any) -> str:
    if tp is type(None):
        return "None"
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        names = " or ".join(type_name(a) for a in typing.get_args(tp)).split(" or ")
        return " or ".join(names[:8] + (["..."] if len(names) > 8 else []))
    if origin is not None:
        return getattr(origin, "__name__", str(origin))
    return getattr(tp, "__name__", str(tp))


def fits(value: Any, tp: Any) -> bool:
    """Whether a config value can be passed where ``tp`` is annotated (unknown classes: yes)."""
    if tp is Any or tp is inspect.Parameter.empty:
        return True
    if isinstance(value, (dict, DictConfig)) and "_target_" in value:
        return True  # a nested object: checked on its own
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(fits(value, a) for a in args)
    if origin is Literal:
        return value in args
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return _num(value)
    if tp is str:
        return isinstance(value, str)
    base = origin or tp
    if base in (list, tuple, set, collections.abc.Sequence, collections.abc.Iterable):
        if isinstance(value, str) or not isinstance(value, (list, tuple, ListConfig)):
            return base is collections.abc.Iterable and isinstance(value, (dict, DictConfig))
        return not args or all(fits(v, args[0]) for v in value)
    if base in (dict, collections.abc.Mapping):
        return isinstance(value, (dict, DictConfig))
    if value is None:
        return False
    if isinstance(base, type) and base.__module__ in ("pathlib", "datetime"):
        return isinstance(value, str)
    return True  # an object type (Accelerator, Logger, ...): a string or a nested config may stand for it


def _signature(obj: Any) -> tuple[dict[str, inspect.Parameter], dict[str, Any]]:
    """Parameters and annotations of what a ``_target_`` calls, following ``**kwargs`` into the bases."""
    params: dict[str, inspect.Parameter] = {}
    hints: dict[str, Any] = {}
    chain = [vars(c)["__init__"] for c in inspect.getmro(obj) if "__init__" in vars(c)] if inspect.isclass(obj) else [obj]
    for fn in chain:
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            break
        try:
            hints = typing.get_type_hints(fn) | hints
        except Exception:  # noqa: BLE001 - unresolvable annotations: check names only
            pass
        own = {n: p for n, p in sig.parameters.items() if n != "self"}
        params = {n: p for n, p in own.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)} | params
        if not any(p.kind is p.VAR_KEYWORD for p in own.values()):
            return params, hints
    params["**"] = inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)  # takes anything
    return params, hints


def locate(target: str) -> Any:
    """The object a dotted ``_target_`` names (like Hydra's, without logging its own error first)."""
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        module_name = ".".join(parts[:i])
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name is not None and module_name.startswith(err.name) and i > 1:
                continue  # not a module: an attribute of a shorter prefix
            raise
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"cannot locate {target!r}")


def import_problem(key: str, target: str) -> Problem | None:
    """Why ``target`` cannot be built here (it does not import, or an optional package is missing)."""
    try:
        locate(target)
    except (ImportError, AttributeError) as err:
        missing = (getattr(err, "name", None) if isinstance(err, ImportError) else None) or target
        package = PACKAGES.get(str(missing).split(".")[0])
        fix = (f"pip install {package} (or {INSTALL_FROM_CLONE})" if package else
               "check the spelling, or install the package that provides it")
        return Problem(f"{key}._target_", target, f"cannot import it ({type(err).__name__}: {err})", fix)
    for suffix, (modules, package) in OPTIONAL_PACKAGES.items():
        if target.endswith(suffix) and not any(importlib.util.find_spec(m) for m in modules):
            return Problem(key, f"{{_target_: {target}}}", f"{suffix} needs {' or '.join(modules)}, which is not "
                           "installed", f"pip install {package} (or {INSTALL_FROM_CLONE}), or pick another option")
    return None


def _example(key: str, default: Any) -> str:
    if default is inspect.Parameter.empty or default is dataclasses.MISSING:
        return f"give {key} a valid value"
    return f"{key}={'null' if default is None else default} (the default)"


def _node_problems(key: str, node: DictConfig) -> Iterator[Problem]:
    target = str(node["_target_"])
    problem = import_problem(key, target)
    if problem is not None:
        yield problem
        return
    params, hints = _signature(locate(target))
    schema = SCHEMAS.get(target)
    fields = {f.name: f for f in dataclasses.fields(schema)} if schema else {}
    for name in node:
        name = str(name)
        if name in _HYDRA_KEYS:
            continue
        full = f"{key}.{name}"
        if name not in params and "**" not in params:
            known = ", ".join(n for n in params if n != "**")
            yield Problem(full, _shown(node, name), f"{target.rsplit('.', 1)[-1]} has no argument {name!r}",
                          f"remove it (~{full}) or use one of: {known}")
            continue
        if OmegaConf.is_interpolation(node, name):
            continue  # checked where it is defined
        if OmegaConf.is_missing(node, name):
            yield Problem(full, "???", "is required and not set", f"{full}=VALUE")
            continue
        value = node[name]
        if isinstance(value, (DictConfig, ListConfig)):
            yield from _nested(full, value)
        param = params.get(name)
        default = fields[name].default if name in fields else (param.default if param else inspect.Parameter.empty)
        tp = hints.get(name, inspect.Parameter.empty)
        plain = OmegaConf.to_container(value, resolve=False) if isinstance(value, (DictConfig, ListConfig)) else value
        if not fits(plain, tp):
            yield Problem(full, _shown(node, name), f"must be {type_name(tp)} (the type of "
                          f"{target.rsplit('.', 1)[-1]}'s argument {name})", _example(full, default))
            continue
        if name in fields and "rule" in fields[name].metadata:
            check: Rule = fields[name].metadata["rule"]
            if not check.ok(plain):
                yield Problem(full, _shown(node, name), check.why, _example(full, default))


def _shown(node: DictConfig, name: str) -> Any:
    return unresolved_value(node, name)


def _nested(key: str, node: DictConfig | ListConfig) -> Iterator[Problem]:
    if isinstance(node, DictConfig):
        if "_target_" in node:
            yield from _node_problems(key, node)
            return
        for name in map(str, node):
            if not OmegaConf.is_interpolation(node, name) and isinstance(node[name], (DictConfig, ListConfig)):
                yield from _nested(f"{key}.{name}", node[name])
    else:
        for i in range(len(node)):
            if not OmegaConf.is_interpolation(node, i) and isinstance(node[i], (DictConfig, ListConfig)):
                yield from _nested(f"{key}[{i}]", node[i])


def problems(cfg: DictConfig) -> Iterator[Problem]:
    """Every schema problem of a composed ``train.yaml`` config (the ``hydra`` node is Hydra's own)."""
    job = {f.name: f for f in dataclasses.fields(JobConfig)}
    job_hints = typing.get_type_hints(JobConfig)
    for name in cfg:
        name = str(name)
        if name == "hydra":
            continue
        if name in job and not OmegaConf.is_interpolation(cfg, name):
            value = cfg[name]
            if not fits(value, job_hints[name]):
                yield Problem(name, value, f"must be {type_name(job_hints[name])}", _example(name, job[name].default))
            elif "rule" in job[name].metadata and not job[name].metadata["rule"].ok(value):
                yield Problem(name, value, job[name].metadata["rule"].why, _example(name, job[name].default))
            continue
        if OmegaConf.is_interpolation(cfg, name):
            continue
        value = cfg[name]
        if isinstance(value, (DictConfig, ListConfig)):
            yield from _nested(name, value)
