"""The compatibility layer: one test per private upstream name, nothing private outside ``_compat``,
and no import cycle inside the package."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

from lightning_sync._compat import (TouchPoint, UpstreamChangedError, lightning_api, omegaconf_api, torch_api,
                                    torchft_api)

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_sync"

TOUCH_POINTS = [*lightning_api.TOUCH_POINTS, *torch_api.TOUCH_POINTS, *omegaconf_api.TOUCH_POINTS,
                *torchft_api.TOUCH_POINTS]


@pytest.mark.parametrize("touch_point", TOUCH_POINTS, ids=[t.name.split(" ")[0] for t in TOUCH_POINTS])
def test_private_upstream_name_still_fits(touch_point: TouchPoint) -> None:
    touch_point.verify()  # raises UpstreamChangedError naming the name, its use and the upgrade


def test_a_broken_touch_point_names_the_upgrade(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_sync._compat as compat

    broken = TouchPoint("lightning.Example._gone", "an example", lambda: False)
    with pytest.raises(UpstreamChangedError, match=r"relies on lightning\.Example\._gone \(an example\).*"
                                                   r"tested with lightning 2\.5\.3 to 2\.6\.6.*lightning_sync bug"):
        broken.verify()
    monkeypatch.setattr(compat, "LIGHTNING_TESTED", ("2.0.0", "2.1.0"))  # as if lightning were upgraded past it
    with pytest.raises(UpstreamChangedError, match=r"the upgrade to lightning 2\.\d+\.\d+ broke it"):
        broken.verify()


# Private Lightning/torch names lightning_sync has used (issue 13's inventory) plus the generic
# shapes of a private upstream import or module path.
UPSTREAM_PRIVATE = [
    "_StrategyRegistry", "_PATH", "_get_process_group_backend", "_current_fx_name", "_layer_sync",
    "_start_method", "_launch_process_observer", "_set_num_threads_if_needed", "_SubprocessScriptLauncher",
    "_check_can_spawn_children", "_combined_loader", "_results", "_IndexBatchSamplerWrapper",
    "_BatchNorm", "_ddp_params_and_buffers_to_ignore", "_world", "_lightning_module",
    "_ddp_kwargs", "_checkpoint_io", "_fit_impl",
]
GENERIC = [r"from (lightning|torch|pytorch_lightning)[\w.]* import [^#\n]*\b_[A-Za-z]",
           r"\b(lightning|torch)(\.[a-z]\w*)*\._[a-z]\w*",
           r"\b(dist|c10d|distributed_c10d)\._[a-z]\w*",  # through the usual aliases of torch.distributed
           r"\btorch\._C\b",
           r"\._get_node\(", r"\._value\(\)"]  # OmegaConf's node API

# Files that must keep a private upstream name outside _compat, and why.
ALLOWED = {
    # Overrides of private hooks the subclass must define by name (checked in _compat's TOUCH_POINTS):
    "lightning_sync/strategy.py:_configure_launcher": "DDPStrategy's launcher hook",
    "lightning_sync/launcher.py:_call_children_scripts": "the launcher base class's hook",
}


def _allowed(path: str, line: str) -> bool:
    return any(path.startswith(key) if ":" not in key else (path == key.split(":")[0] and key.split(":")[1] in line)
               for key in ALLOWED)


def test_private_upstream_names_only_in_compat() -> None:
    pattern = "|".join([rf"\b{re.escape(n)}\b" for n in UPSTREAM_PRIVATE] + GENERIC)
    out = subprocess.run(["git", "grep", "-n", "-E", pattern, "--", "lightning_sync", ":!lightning_sync/_compat"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode in (0, 1), out.stderr
    hits = []
    for line in out.stdout.splitlines():
        path, _, text = line.split(":", 2)
        if not _allowed(path, text):
            hits.append(line)
    assert not hits, ("private Lightning/torch names outside lightning_sync/_compat (add an accessor and a "
                      "TouchPoint there):\n" + "\n".join(hits))


def _imports(path: Path, module: str) -> set[str]:
    """lightning_sync modules ``module`` imports (at any depth in the file)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("lightning_sync")}
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:
                parts = module.split(".")
                base = ".".join(parts[: len(parts) - node.level] + [node.module])
            if base.startswith("lightning_sync"):
                found.add(base)
                found |= {f"{base}.{a.name}" for a in node.names}
    return found


def test_import_graph_has_no_cycle() -> None:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        modules[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        if name == "lightning_sync":  # the public API re-exports everything: not a layer
            continue
        targets = set()
        for target in _imports(path, name):
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            # importing lightning_sync.a.b runs lightning_sync.a's __init__ too (but not lightning_sync's)
            parts = target.split(".")
            targets |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)}
        graph[name] = {t for t in targets if t in modules and t != name and t != "lightning_sync"}

    def cycle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    return [*path, start]
                if nxt not in path and len(path) < len(graph):
                    stack.append((nxt, [*path, nxt]))
        return None

    cycles = [c for c in map(cycle_from, sorted(graph)) if c]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_device_id_is_passed_only_where_torch_takes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from lightning_sync._compat.torch_api import init_process_group_kwargs

    assert init_process_group_kwargs("cuda:0") == {"device_id": "cuda:0"}  # torch 2.3 on
    assert init_process_group_kwargs(None) == {}

    def before_2_3(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None,  # type: ignore[no-untyped-def]
                   group_name="", pg_options=None):
        pass

    monkeypatch.setattr(dist, "init_process_group", before_2_3)
    assert init_process_group_kwargs("cuda:0") == {}
