"""How lightning_sync's object collectives put a Python object on the wire, and read a peer's back.

:func:`to_bytes` pickles an object into a uint8 tensor, plain tensors inside it as raw bytes (no ``torch.save``
on ranks that write no file); :func:`from_bytes` reads one back, with ``safe=True`` through an unpickler that
looks up no global outside a short allow-list (:data:`_SAFE_GLOBALS`), so a peer's bytes cannot run code
(``docs/security.md``). No communication here: ``lightning_sync.collectives`` sends the bytes.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch import Tensor

__all__ = ["from_bytes", "to_bytes"]


class _Pickler(pickle.Pickler):
    """Pickles plain CPU tensors as raw bytes: no ``torch.save`` (a tensor's own pickling runs it for the
    storage) on ranks that write no file, and a format the restricted unpickler can read."""

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is Tensor and obj.layout == torch.strided and obj.device.type in ("cpu", "cuda"):
            flat = obj.detach().contiguous().reshape(-1).cpu()
            raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
            return ("tensor", str(obj.dtype).removeprefix("torch."), tuple(obj.shape), raw, obj.requires_grad,
                    obj.device.type)
        return None


# What safe=True lets a peer's bytes name besides plain containers (every other global is refused).
_SAFE_GLOBALS = {("builtins", n) for n in ("set", "frozenset", "complex", "bytearray", "slice", "range")} | {
    ("collections", "OrderedDict"), ("torch", "Size")}


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: Any, safe: bool) -> None:
        super().__init__(file)
        self._safe = safe

    def persistent_load(self, pid: Any) -> Any:
        kind, dtype_name, shape, raw, requires_grad, device = pid
        dtype = getattr(torch, dtype_name, None)
        if kind != "tensor" or not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(f"unknown persistent id {kind!r} {dtype_name!r}")
        if raw:
            tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
        else:
            tensor = torch.empty(shape, dtype=dtype)
        if device == "cuda" and torch.cuda.is_available():  # a CUDA tensor lands on this rank's current device
            tensor = tensor.to(torch.device("cuda", torch.cuda.current_device()))
        return tensor.requires_grad_(bool(requires_grad)) if requires_grad else tensor

    def find_class(self, module: str, name: str) -> Any:
        if self._safe and (module, name) not in _SAFE_GLOBALS and not (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            raise pickle.UnpicklingError(f"{module}.{name} is not plain data")
        return super().find_class(module, name)


def to_bytes(obj: Any) -> Tensor:
    """``obj`` pickled into a uint8 tensor (plain tensors inside as raw bytes, see :class:`_Pickler`)."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)


def from_bytes(buf: Tensor, safe: bool) -> Any:
    """The object :func:`to_bytes` made. ``safe``: plain containers, numbers, strings, tensors and dtypes only; no
    other global is looked up, so no code a peer chose runs here (``docs/security.md``)."""
    return _Unpickler(io.BytesIO(buf.cpu().numpy().tobytes()), safe).load()
