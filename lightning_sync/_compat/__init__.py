"""Every private Lightning and torch name lightning_sync relies on, in one place.

Lightning and torch keep these names out of their public API, so any release may rename them. Each
one is reached through a function or alias in :mod:`._compat.torch_api` (torch only: importable by
``collectives`` and ``batchnorm``, which never import Lightning) or :mod:`._compat.lightning_api`, and
listed in that module's ``TOUCH_POINTS`` with a check that it still has the shape we use.
``tests/test_compat.py`` runs one test per touch point; a failure names the upgrade that broke it.
Everywhere else the package uses public names only (``tests/test_compat.py`` greps for it).

Public equivalents used instead of private names: ``lightning.pytorch.strategies.StrategyRegistry``
(registry), ``Strategy.distributed_sampler_kwargs`` (the sampler seed, instead of ``PL_GLOBAL_SEED``),
``Strategy.process_dataloader`` (worker seeding), ``torch.distributed.group.WORLD`` (instead of
``_get_default_group()``), ``Strategy.lightning_module``,
``trainer.train_dataloader`` (processed training loaders, instead of the fit loop's
``_combined_loader``), ``str | pathlib.Path`` (instead of ``_PATH``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version

__all__ = ["LIGHTNING_TESTED", "TORCH_TESTED", "TouchPoint", "UpstreamChangedError", "installed"]

#: The releases CI runs the suite on (oldest: fast tier; newest: everything). setup.cfg states the same.
LIGHTNING_TESTED = ("2.5.3", "2.6.6")
TORCH_TESTED = ("2.13.0", "2.13.0")


def installed() -> str:
    """``lightning X / torch Y``, as installed."""
    return f"lightning {version('lightning')} / torch {version('torch')}"


class UpstreamChangedError(RuntimeError):
    """A private Lightning/torch name lightning_sync relies on is gone or changed shape."""


@dataclass(frozen=True)
class TouchPoint:
    """One private upstream name: where it lives, what lightning_sync uses it for, how to check it."""

    name: str
    used_for: str
    check: Callable[[], bool]

    def verify(self) -> None:
        """Raise :class:`UpstreamChangedError`, naming the upgrade, unless the name still fits."""
        try:
            ok = self.check()
        except Exception as exc:  # AttributeError, ImportError, a changed signature: all mean "changed"
            raise self.error() from exc
        if not ok:
            raise self.error()

    def error(self) -> UpstreamChangedError:
        lightning, torch = version("lightning"), version("torch").split("+")[0]
        tested = (f"lightning_sync is tested with lightning {LIGHTNING_TESTED[0]} to {LIGHTNING_TESTED[-1]} and torch "
                  f"{TORCH_TESTED[0]} to {TORCH_TESTED[-1]}")
        newer = [f"lightning {lightning}" if _newer(lightning, LIGHTNING_TESTED[-1]) else "",
                 f"torch {torch}" if _newer(torch, TORCH_TESTED[-1]) else ""]
        cause = (f"the upgrade to {' and '.join(n for n in newer if n)} broke it: pin the newest tested versions or "
                 "upgrade lightning_sync" if any(newer) else
                 "this is a lightning_sync bug for the versions installed: please report it")
        return UpstreamChangedError(
            f"lightning_sync relies on {self.name} ({self.used_for}); it is missing or changed in {installed()}. "
            f"{tested}; {cause}.")


def _newer(installed_version: str, tested: str) -> bool:
    from packaging.version import Version

    return Version(installed_version) > Version(tested)
