"""SyncBatchNorm that runs on every backend: gloo on CPU as well as NCCL on CUDA.

``torch.nn.SyncBatchNorm`` only runs on GPUs: its five kernels (``batch_norm_stats`` and friends)
have no CPU implementation, so ``Trainer(accelerator="cpu", strategy="ddp", sync_batchnorm=True)``
fails with "SyncBatchNorm layers only work with GPU modules". :class:`SyncBatchNorm` here has the
same semantics on any device:

* training forward: the batch statistics are those of the union of every rank's batch. Each rank
  computes its own ``(count, mean, M2)`` per channel in one pass, ONE ``all_gather`` exchanges them
  and every rank combines them with Chan's formula in float64 (no ``sum x**2 - (sum x)**2``
  cancellation, so a channel with ``|mean| / std = 300`` keeps its digits). Ranks may have different
  batch sizes, zero included (an empty rank still joins every collective);
* training backward: ONE ``all_gather`` of ``[sum dy, sum dy * xhat]`` per channel, summed in rank
  order on every rank, gives the input gradient ``w * invstd * (dy - sum_dy / n - xhat * sum_dy_xhat /
  n)``; the weight and bias gradients stay local (their sum over ranks is the full-batch gradient;
  DDP averages them);
* both exchanges go through the layer's process group (the world's, or the one passed as
  ``process_group``), so torch's timeouts, flight recorder and profiler see them;
* running statistics use the unbiased global variance, as torch does, and are identical on every rank;
* eval mode, and training without a process group (or with a group of one), run no collective and
  behave exactly like ``torch.nn.BatchNorm*d``;
* CUDA tensors on a non-gloo group (NCCL) go through torch's own SyncBatchNorm kernels.

The module subclasses torch's BatchNorm base class (not ``nn.SyncBatchNorm``), so DDP's "SyncBatchNorm layers only
work with GPU modules" check does not apply to it.

:func:`convert_sync_batchnorm` / :func:`revert_sync_batchnorm` swap layers in a model and back,
keeping the very same parameter and buffer tensors. The Lightning wiring (``LayerSync`` plugin and
callback) lives in :mod:`lightning_sync.callbacks.batchnorm`; this module imports torch only.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx, once_differentiable

from lightning_sync import collectives
from lightning_sync._compat.torch_api import DDP_IGNORE_ATTR, BatchNormBase, TorchSyncBatchNormFunction
from lightning_sync.errors import RankMismatchError, format_ranks

__all__ = [
    "SyncBatchNorm",
    "convert_sync_batchnorm",
    "dedicated_group",
    "exchange_across",
    "joined_step",
    "per_rank_batchnorm",
    "revert_sync_batchnorm",
    "share_running_stats",
    "unshare_running_stats",
]

#: Attribute users can set on a BatchNorm layer to keep it out of :func:`convert_sync_batchnorm`.
EXCLUDE_ATTR = "sync_batchnorm"


# Attributes this module adds to a converted layer; revert removes them again.
_ORIGINAL_CLASS = "_lsync_original_class"
_ORIGINAL_GROUP = "_lsync_original_process_group"
_SEEN_NDIM = "_lsync_seen_ndim"
# layer -> the group its metadata was last compared over (a weak reference). Kept outside the layer: a
# ProcessGroup cannot be pickled, and converted models are (torch.save of the modules that
# save_hyperparameters records, copy.deepcopy by EMA/SWA callbacks). A copy compares again when it trains.
_CHECKED_GROUPS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Any]] = weakref.WeakKeyDictionary()
_MISSING = object()
_M = TypeVar("_M", bound=nn.Module)
# Inside joined_step: whether this rank's batch is a stand-in (None: an ordinary step).
_JOINED: contextvars.ContextVar[bool | None] = contextvars.ContextVar("lightning_sync_joined_step", default=None)
#: A layer's rows, as its process group gathered them -> every replica group's rows (see exchange_across).
RowsAcross = Callable[[Tensor], Tensor]
_across: RowsAcross | None = None


def exchange_across(rows_across: RowsAcross | None) -> RowsAcross | None:
    """Synchronise every :class:`SyncBatchNorm` of this process beyond its process group (``None``: stop); returns
    the exchange set before. Each training exchange (the statistics in forward, the gradient sums in backward)
    first gathers one row per rank of the layer's group, then hands those rows to ``rows_across``, which returns
    the rows of every rank beyond it too, in the one order every process sees (``ddp_sync_ft``: every live replica
    group's, through torchft's all-reduce), or the rows it was given where no exchange took place. With it set, a
    layer takes the portable path, a process group of one rank included."""
    global _across
    before, _across = _across, rows_across
    return before


@contextlib.contextmanager
def joined_step(stand_in: bool) -> Iterator[None]:
    """A training step in which some rank has run out of data (``uneven_batches="join"``; every rank enters
    it for the same step). Inside, every :class:`SyncBatchNorm` takes the portable path on every backend,
    and on a rank whose batch is a ``stand_in`` contributes a count of zero: the statistics, the running
    statistics and the input gradients are those of the real ranks' samples only. The stand-in's output is
    its batch normalised with those statistics (its loss is scaled to zero anyway)."""
    token = _JOINED.set(bool(stand_in))
    try:
        yield
    finally:
        _JOINED.reset(token)


# --------------------------------------------------------------------------------------------------
# the autograd function (portable path)


def _reduce_dims(x: Tensor) -> list[int]:
    return [0, *range(2, x.ndim)]


def _per_channel(t: Tensor, ndim: int) -> Tensor:
    """(C,) -> (1, C, 1, ...) so it broadcasts against an (N, C, ...) input."""
    return t.view(1, -1, *([1] * (ndim - 2)))


def _local_stats(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-channel mean and biased variance of a non-empty ``(N, C, ...)`` batch, in one pass."""
    # Half precision is reduced in float32, as torch's BatchNorm kernels do.
    reduced = x if x.dtype in (torch.float32, torch.float64) else x.float()
    if x.device.type in ("cpu", "cuda"):
        # torch's own BatchNorm statistics kernel: accumulates in double on CPU, ~100x faster than
        # var_mean over dim 0 of an (N, C) batch.
        mean, var = torch.batch_norm_update_stats(reduced, None, None, 0.0)
        return mean, var
    var, mean = torch.var_mean(reduced, dim=_reduce_dims(x), correction=0)
    return mean, var


#: Where the collective guard says a layer's backward exchange was made (autograd runs it: no user frame).
_BACKWARD_SITE = "SyncBatchNorm backward"


def _group_name(group: dist.ProcessGroup) -> str:
    return "the default group" if group is dist.group.WORLD else "its process group"


class _PortableSyncBatchNorm(torch.autograd.Function):
    """Synchronised batch norm from plain tensor ops and two gloo/NCCL collectives; any device."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, input: Tensor, weight: Tensor | None, bias: Tensor | None,
        running_mean: Tensor | None, running_var: Tensor | None, eps: float, momentum: float,
        group: dist.ProcessGroup, world_size: int, stand_in: bool = False, across: RowsAcross | None = None,
    ) -> Tensor:
        channels = input.shape[1]
        ctx.world_size, ctx.across = world_size, across  # type: ignore[attr-defined]
        local_count = 0 if stand_in else input.numel() // channels
        ctx.stand_in = stand_in  # type: ignore[attr-defined]
        # One record per rank: [count, mean (C), M2 (C)] in float64, so the combine below is exact
        # enough even when |mean| / std is in the thousands.
        if local_count > 0:
            mean, var = _local_stats(input)
            mean64 = mean.double()  # float64 before scaling: counts above 2**24 stay exact
            record = torch.cat([mean64.new_full((1,), local_count), mean64, var.double().mul_(local_count)])
        else:
            record = torch.zeros(2 * channels + 1, dtype=torch.float64, device=input.device)
        gathered = (collectives.all_gather_rows(record, group, "SyncBatchNorm statistics") if world_size > 1
                    else record.unsqueeze(0))
        if across is not None:
            gathered = across(gathered)

        counts = gathered[:, 0]
        if bool((counts < 0).any()):  # a rank's input was refused (see SyncBatchNorm.forward): raise it here too
            _raise_input_problems(None, group)
        total = int(counts.sum().item())
        if total == 1:
            per_rank = [int(c) for c in counts.tolist()]
            raise ValueError(
                f"Expected more than 1 value per channel when training, got input size {input.size()} on this "
                f"rank and 1 value per channel over all {world_size} ranks of {_group_name(group)} "
                f"({format_ranks(per_rank)}). Use a larger batch, drop the last incomplete batch "
                "(DataLoader(drop_last=True)), or put the layer in eval mode."
            )
        # Statistics in float32 at least (half inputs), float64 for float64 inputs, as torch's kernels do.
        stat_dtype = torch.float64 if input.dtype == torch.float64 else torch.float32
        ctx.total = total  # type: ignore[attr-defined]
        ctx.group = group  # type: ignore[attr-defined]
        if total == 0:
            # Every rank's batch is empty: torch's BatchNorm returns an empty output and leaves the
            # running statistics alone; so do we. Backward still joins its collective.
            zeros = input.new_zeros(channels, dtype=stat_dtype)
            ctx.save_for_backward(input, weight, zeros, zeros)  # type: ignore[arg-type]  # None is fine
            return torch.zeros_like(input) if stand_in else torch.empty_like(input)

        # Chan et al.: mean = sum n_r mean_r / n;  M2 = sum M2_r + sum n_r (mean_r - mean)^2.
        means = gathered[:, 1:channels + 1]
        m2s = gathered[:, channels + 1:]
        weights = counts.unsqueeze(1)
        g_mean = (weights * means).sum(0).div_(total)
        g_m2 = m2s.sum(0).add_((weights * (means - g_mean).square_()).sum(0))

        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                unbiased = g_m2 / (total - 1)
                running_mean.mul_(1 - momentum).add_(g_mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)

        g_var = g_m2.div_(total)
        mean_t = g_mean.to(stat_dtype)
        ctx.save_for_backward(input, weight, mean_t,  # type: ignore[arg-type]  # None is fine
                              (g_var + eps).rsqrt_().to(stat_dtype))
        if local_count == 0 and not (stand_in and input.numel() > 0):
            return torch.empty_like(input)
        # The global statistics in the place of running ones: torch's own fused CPU/CUDA kernel.
        return F.batch_norm(input, mean_t, g_var.to(stat_dtype), weight, bias, False, 0.0, eps)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        input, weight, mean, invstd = ctx.saved_tensors  # type: ignore[attr-defined]
        total: int = ctx.total  # type: ignore[attr-defined]
        group: dist.ProcessGroup = ctx.group  # type: ignore[attr-defined]
        needs_input, needs_weight, needs_bias = ctx.needs_input_grad[:3]  # type: ignore[attr-defined]
        channels = input.shape[1]
        ndim = input.ndim
        local = input.numel() > 0 and total > 0 and not ctx.stand_in  # type: ignore[attr-defined]

        if local:
            dims = _reduce_dims(input)
            # x - mean, not sum(dy * x) - mean * sum(dy): that cancels when |mean| >> std.
            xmu = input - _per_channel(mean, ndim)
            sum_dy = grad_output.sum(dims, dtype=mean.dtype)
            sum_dy_xhat = (grad_output * xmu).sum(dims, dtype=mean.dtype).mul_(invstd)
        else:
            xmu = input
            sum_dy = input.new_zeros(channels, dtype=mean.dtype)
            sum_dy_xhat = input.new_zeros(channels, dtype=mean.dtype)
        # Weight and bias gradients stay local: their sum over ranks is the full-batch gradient.
        grad_weight = sum_dy_xhat.to(weight.dtype) if weight is not None and needs_weight else None
        grad_bias = sum_dy.to(weight.dtype if weight is not None else input.dtype) if needs_bias else None

        grad_input = None
        if needs_input:
            # Every rank joins this exchange, an empty one too, or its peers would wait forever. Gathered and
            # summed in rank order on every rank (not all-reduced): the same numbers whatever order the backend's
            # reduction takes, so one host of 4 ranks and two hosts of 2 train bit for bit alike.
            combined = torch.cat([sum_dy, sum_dy_xhat])
            rows = (collectives.all_gather_rows(combined, group, "SyncBatchNorm gradient sums", site=_BACKWARD_SITE)
                    if ctx.world_size > 1 else combined.unsqueeze(0))  # type: ignore[attr-defined]
            across: RowsAcross | None = ctx.across  # type: ignore[attr-defined]
            combined = (rows if across is None else across(rows)).sum(0)
            if local:
                combined.div_(total)
                mean_dy, mean_dy_xhat = combined[:channels], combined[channels:]
                scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
                # dx = w * invstd * (dy - mean(dy) - xhat * mean(dy * xhat)), means over all ranks,
                #    = dy * scale + xmu * (-scale * invstd * mean(dy * xhat)) - scale * mean(dy): two fused passes.
                grad_input = torch.addcmul(_per_channel(-scale * mean_dy, ndim), grad_output,
                                           _per_channel(scale, ndim))
                grad_input.addcmul_(xmu, _per_channel(-scale * invstd * mean_dy_xhat, ndim))
                grad_input = grad_input.to(input.dtype)
            else:
                grad_input = torch.zeros_like(input)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None, None, None


def _raise_problem_text(problems: dict[int, str], world: int) -> None:
    listed = "; ".join(f"rank {r}: {p}" for r, p in problems.items())
    where = "rank" if len(problems) == 1 else "ranks"
    raise ValueError(f"SyncBatchNorm: bad input on {where} {', '.join(map(str, problems))} of {world} (every rank "
                     f"raises this error): {listed}")


def _raise_input_problems(problem: str | None, group: dist.ProcessGroup) -> None:
    """Error path of a later step: every rank learns every rank's refused input, then raises it."""
    every: list[Any] = collectives.gather_objects(problem, group=group, safe=True) or []
    ranks = collectives._global_ranks(group)
    _raise_problem_text({r: p for r, p in zip(ranks, every) if p is not None}, len(ranks))


# --------------------------------------------------------------------------------------------------
# the module


class SyncBatchNorm(BatchNormBase):
    """Batch normalisation over the union of every rank's batch, on any backend.

    A drop-in replacement for ``torch.nn.SyncBatchNorm`` (same arguments, same results) that also
    runs on CPU with gloo. Accepts ``(N, C)``, ``(N, C, L)``, ``(N, C, H, W)`` and
    ``(N, C, D, H, W)`` inputs.

    In training mode with more than one rank in ``process_group`` every forward and every backward
    is a collective: **every rank of the group must run it**, also a rank whose batch is empty, and
    each blocks until all ranks have arrived. In eval mode, or when ``torch.distributed`` is not
    initialised or the group has a single rank, no collective runs and the layer computes exactly what
    ``torch.nn.BatchNorm*d`` computes.

    Args:
        num_features: number of channels ``C``.
        eps: added to the variance for numerical stability.
        momentum: weight of the new batch in the running statistics; ``None`` for a cumulative
            moving average over ``num_batches_tracked`` batches.
        affine: learn a per-channel weight and bias.
        track_running_stats: keep running mean and variance (used in eval mode).
        process_group: the ranks to synchronise over; ``None`` means the default (world) group.
        device: where to create parameters and buffers.
        dtype: their dtype.
        bias: learn a bias (only with ``affine=True``).

    The first distributed training forward of each layer also compares, across the ranks of its
    group, whether each rank's input is acceptable, ``num_features``, the input dtype and the input
    rank (one small exchange per layer, not per step); later, a refused input on one rank is flagged
    inside the statistics exchange itself. Either way every rank raises the same error instead of
    gloo aborting one process on mismatched sizes and another carrying on with garbage statistics.

    Raises:
        ValueError: the input is one torch's layer refuses (a converted ``BatchNorm2d`` takes 4-D
            input only), or its channel count is not ``num_features``; in training mode, the batch
            over all ranks holds a single value per channel. Raised on every rank when distributed.
        RankMismatchError: ``num_features``, input dtype or input rank differ across ranks.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, bias=bias)
        self.process_group = process_group

    def _check_input_dim(self, input: Tensor) -> None:
        problem = self._input_problem(input)
        if problem is not None:
            raise ValueError(problem)

    def _input_problem(self, input: Any) -> str | None:
        """Why torch's layer would refuse ``input`` (this layer's original class decides), or None."""
        if not isinstance(input, Tensor):
            return f"expected a tensor input, got {type(input).__name__}"
        original = self.__dict__.get(_ORIGINAL_CLASS)
        check = getattr(original, "_check_input_dim", None) if original is not None else None
        try:
            if check is not None:  # a converted BatchNorm2d accepts 4-D input only, as before conversion
                check(self, input)
            elif input.dim() < 2:
                raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
        except NotImplementedError:  # the BatchNorm base class: any dimensionality of at least 2
            if input.dim() < 2:
                return f"expected at least 2D input (got {input.dim()}D input)"
        except ValueError as err:
            return str(err)
        if input.dim() < 2:
            return f"expected at least 2D input (got {input.dim()}D input)"
        if input.size(1) == 0:
            return "SyncBatchNorm number of input channels should be non-zero"
        if input.size(1) != self.num_features:
            return (f"expected input with {self.num_features} channels (dim 1) for this layer, got "
                    f"{input.size(1)} (input shape {tuple(input.shape)})")
        if not (input.is_floating_point() or input.is_complex()):
            return f"expected a floating point input, got {input.dtype}"
        return None

    def _agree(self, input: Tensor, problem: str | None, group: dist.ProcessGroup | None) -> None:
        """Once per layer and group (its first distributed training forward): every rank reports its input
        problem, channel count, dtype and input rank, and every rank raises the same error if any is off.

        After that, a refused input on one rank is signalled inside the statistics exchange itself, so
        the steady state costs no extra collective."""
        checked = _CHECKED_GROUPS.get(self)
        if checked is not None and checked() is group and group is not None:
            portable = collectives.backend_for(group, self._device()) == "gloo" or self._device().type != "cuda"
            if problem is not None and portable:  # join this step's statistics exchange with a flag, then explain
                flag = torch.full((2 * self.num_features + 1,), -1.0, dtype=torch.float64, device=self._device())
                collectives.all_gather_rows(flag, group, "SyncBatchNorm statistics")
                _raise_input_problems(problem, group)
            if problem is not None:  # torch's NCCL kernels: no room for a flag in their exchange
                raise ValueError(problem)
            return
        dtype = str(input.dtype).removeprefix("torch.") if isinstance(input, Tensor) else "-"
        ndim = input.dim() if isinstance(input, Tensor) else -1
        mine = (problem, self.num_features, dtype, ndim)
        every: list[Any] = collectives.gather_objects(mine, group=group, safe=True) or []
        ranks = collectives._global_ranks(group)
        problems = {r: p for r, (p, *_) in zip(ranks, every) if p is not None}
        if problems:
            _raise_problem_text(problems, len(ranks))
        for what, at, fix in (
                ("num_features", 1, "Build the same model on every rank (the channel count must not depend on the "
                                    "rank)."),
                ("input dtype", 2, "Feed the same dtype on every rank (the same autocast / precision setting)."),
                ("input dimensions", 3, "Feed inputs of the same rank (N, C, ...) on every rank.")):
            values = {r: entry[at] for r, entry in zip(ranks, every)}
            if len(set(values.values())) > 1:
                raise RankMismatchError(f"SyncBatchNorm: {what} differs across ranks: {format_ranks(values)}. {fix}",
                                        values)
        if group is not None:
            _CHECKED_GROUPS[self] = weakref.ref(group)

    def _device(self) -> torch.device:
        for t in (self.weight, self.running_mean):
            if t is not None:
                return t.device
        return torch.device("cpu")

    def forward(self, input: Tensor) -> Tensor:
        """Normalise ``input``; a collective in training mode when distributed (see the class doc)."""
        problem = self._input_problem(input)
        group_ = self.process_group if self.process_group is not None else dist.group.WORLD
        distributed = (self.training and dist.is_available() and dist.is_initialized()
                       and dist.get_world_size(group_) > 1)
        if distributed:
            # every rank hears about a bad input on any rank, instead of gloo aborting on mismatched sizes
            self._agree(input, problem, group_)
        elif problem is not None:
            raise ValueError(problem)
        # Remembered so that revert_sync_batchnorm can give back a BatchNorm of the right dimensionality.
        self.__dict__[_SEEN_NDIM] = input.dim()

        # Everything down to F.batch_norm mirrors torch's BatchNorm forward, so the two agree exactly.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        running_mean = self.running_mean if not self.training or self.track_running_stats else None
        running_var = self.running_var if not self.training or self.track_running_stats else None

        group = self.process_group if self.process_group is not None else dist.group.WORLD
        world_size = 1
        if bn_training and self.training and dist.is_available() and dist.is_initialized():
            world_size = dist.get_world_size(group)  # -1 when this rank is not in the group
        across = _across if bn_training and self.training else None
        if world_size <= 1 and across is None:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, bn_training, factor,
                                self.eps)
        # torch's own kernels are CUDA-only and fused: use them for CUDA tensors on NCCL (and other
        # non-gloo backends); everything else takes the portable path, and so does every rank in a step
        # with a stand-in batch (joined_step), which torch's kernels would count.
        stand_in = _JOINED.get()
        if (stand_in is None and across is None and input.is_cuda
                and collectives.backend_for(group, input.device) != "gloo"):
            return TorchSyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean, running_var,  # type: ignore[no-untyped-call,no-any-return]
                                             self.eps, factor, group, world_size)
        return _PortableSyncBatchNorm.apply(input, self.weight, self.bias, running_mean,  # type: ignore[no-untyped-call,no-any-return]
                                            running_var, self.eps, factor, group, max(world_size, 1),
                                            bool(stand_in), across)


# --------------------------------------------------------------------------------------------------
# conversion


def _clone_into(cls: type[_M], module: nn.Module, drop: Iterable[str] = ()) -> _M:
    """A ``cls`` instance holding ``module``'s state: the same parameter and buffer tensors, hooks,
    training flag and every other attribute (``qconfig``, user attributes), without calling
    ``cls.__init__`` (so BatchNorm subclasses with their own ``__init__`` signature convert too).
    Containers are copied so the old object, if still referenced elsewhere, does not change."""
    new = cls.__new__(cls)
    state = {k: copy.copy(v) if isinstance(v, (dict, set, list)) else v
             for k, v in module.__dict__.items() if k not in drop}
    new.__dict__.update(state)
    return new


def _is_frozen(module: BatchNormBase) -> bool:
    params = [p for p in (module.weight, module.bias) if p is not None]
    return bool(params) and not any(p.requires_grad for p in params)


def _excluded(name: str, exclude: tuple[str, ...]) -> bool:
    return any(name == e or name.startswith(e + ".") for e in exclude)


def convert_sync_batchnorm(
    module: nn.Module,
    process_group: dist.ProcessGroup | None = None,
    exclude: Iterable[str] = (),
) -> nn.Module:
    """Replace every BatchNorm layer in ``module`` by a :class:`SyncBatchNorm`, recursively.

    Converts ``BatchNorm1d/2d/3d``, ``torch.nn.SyncBatchNorm`` and any other subclass of torch's
    BatchNorm base class. The new layer holds the very same parameter and buffer tensors (so device, dtype,
    ``requires_grad`` and optimizer references are kept), the training flag, hooks and other
    attributes, and remembers the original class for :func:`revert_sync_batchnorm`. Runs no
    collective; call it before wrapping the model in DDP.

    Left alone, and named in one warning (on rank 0 only when distributed):

    * frozen layers: affine layers whose weight and bias all have ``requires_grad=False``;
    * layers whose ``sync_batchnorm`` attribute is ``False`` (``model.bn.sync_batchnorm = False``);
    * layers named in ``exclude``, or below a module named there.

    Args:
        module: a model, or a single BatchNorm layer.
        process_group: the group to synchronise over; ``None`` keeps a ``torch.nn.SyncBatchNorm``'s
            own group and otherwise means the default (world) group.
        exclude: qualified module names (as in ``named_modules()``) to leave unsynchronised.

    Returns:
        ``module`` with its layers replaced in place, or a new layer if ``module`` itself is one.
    """
    skipped: list[str] = []
    out = _convert(module, process_group, tuple(exclude), "", skipped)
    if skipped and (not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0):
        warnings.warn(
            f"convert_sync_batchnorm: left {len(skipped)} BatchNorm layer(s) unsynchronised (frozen, excluded or "
            f"marked `sync_batchnorm = False`): {', '.join(skipped)}. Their batch statistics stay per rank.",
            UserWarning, stacklevel=2,
        )
    return out


def _convert(module: nn.Module, group: dist.ProcessGroup | None, exclude: tuple[str, ...], name: str,
             skipped: list[str]) -> nn.Module:
    out = module
    if isinstance(module, BatchNormBase) and not isinstance(module, SyncBatchNorm):
        label = name or type(module).__name__
        if _is_frozen(module) or getattr(module, EXCLUDE_ATTR, True) is False or _excluded(name, exclude):
            skipped.append(label)
            return module
        if any(isinstance(t, nn.parameter.UninitializedParameter | nn.parameter.UninitializedBuffer)
               for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]):
            raise ValueError(f"convert_sync_batchnorm: {label} is a lazy BatchNorm that has not seen an input yet; "
                             "run one forward pass (or build it with num_features) before converting.")
        sync = _clone_into(SyncBatchNorm, module)
        sync.__dict__[_ORIGINAL_CLASS] = type(module)
        sync.__dict__[_ORIGINAL_GROUP] = module.__dict__.get("process_group", _MISSING)
        own_group = module.__dict__.get("process_group") if isinstance(module, nn.SyncBatchNorm) else None
        sync.process_group = group if group is not None else own_group
        out = sync
    elif isinstance(module, SyncBatchNorm) and group is not None:
        module.process_group = group
    for child_name, child in list(out._modules.items()):
        if child is not None:
            qualified = f"{name}.{child_name}" if name else child_name
            out._modules[child_name] = _convert(child, group, exclude, qualified, skipped)
    return out


_BY_NDIM: dict[int, type[BatchNormBase]] = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


class _BatchNormXd(BatchNormBase):
    """A BatchNorm for any input dimensionality: what a never-used SyncBatchNorm reverts to."""

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")


def per_rank_batchnorm(module: nn.Module) -> list[str]:
    """Names of ``module``'s BatchNorm layers in training mode whose statistics are each rank's own (neither
    lightning_sync's nor torch's SyncBatchNorm)."""
    return [name for name, m in module.named_modules()
            if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d))
            and not isinstance(m, (nn.SyncBatchNorm, SyncBatchNorm)) and m.training]


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Undo :func:`convert_sync_batchnorm`: every :class:`SyncBatchNorm` becomes a plain layer again.

    A converted layer gets back its original class (``BatchNorm2d`` stays ``BatchNorm2d``, a
    ``torch.nn.SyncBatchNorm`` gets back its own process group). A :class:`SyncBatchNorm` built
    directly becomes ``BatchNorm1d/2d/3d`` after the dimensionality of the last input it saw, or a
    dimension-agnostic BatchNorm if it never saw one. Parameters, buffers, training flag, hooks and
    attributes are kept as in :func:`convert_sync_batchnorm`. Runs no collective.

    Returns:
        ``module`` with its layers replaced in place, or a new layer if ``module`` itself is one.
    """
    out = module
    if isinstance(module, SyncBatchNorm):
        cls: type[nn.Module] | None = module.__dict__.get(_ORIGINAL_CLASS)
        if cls is None:
            cls = _BY_NDIM.get(module.__dict__.get(_SEEN_NDIM, 0), _BatchNormXd)
        original_group: Any = module.__dict__.get(_ORIGINAL_GROUP, _MISSING)
        out = _clone_into(cls, module, drop=(_ORIGINAL_CLASS, _ORIGINAL_GROUP, _SEEN_NDIM, "process_group"))
        if original_group is not _MISSING:
            out.__dict__["process_group"] = original_group
    for child_name, child in list(out._modules.items()):
        if child is not None:
            out._modules[child_name] = revert_sync_batchnorm(child)
    return out


# --------------------------------------------------------------------------------------------------
# a process group of its own


_DEDICATED: tuple[Any, dist.ProcessGroup] | None = None


def dedicated_group() -> dist.ProcessGroup | None:
    """A gloo group spanning the world, reserved for SyncBatchNorm's collectives; created once.

    On gloo, a blocking SyncBatchNorm collective on the default group waits behind DDP's asynchronous
    gradient all-reduces queued on that same group; a group of its own runs beside them.

    **A collective the first time**: every rank must call it, at the same point of the program
    (``dist.new_group`` is). Later calls return the cached group without communicating, until the
    default group is destroyed and re-created.

    Returns:
        The group, or ``None`` when not distributed or when the default backend is not gloo (NCCL
        runs each group on its own CUDA stream; torch's kernels use the default group there).
    """
    global _DEDICATED
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return None
    if collectives.backend_for(None, "cpu") != "gloo":
        return None
    world = dist.group.WORLD
    if _DEDICATED is None or _DEDICATED[0] is not world:
        _DEDICATED = (world, dist.new_group(backend="gloo"))
    return _DEDICATED[1]


# --------------------------------------------------------------------------------------------------
# DDP's buffer broadcast is redundant for synchronised running statistics

_DDP_IGNORE = DDP_IGNORE_ATTR


def share_running_stats(model: nn.Module) -> list[str]:
    """Stop DDP from re-broadcasting running statistics that SyncBatchNorm keeps identical anyway.

    With ``broadcast_buffers=True`` (the default, Lightning's too) DDP broadcasts every buffer from
    rank 0 before each training forward: one more blocking collective per step, pure waste for the
    running statistics of a :class:`SyncBatchNorm` synchronised over the whole world, which every
    rank computes from the same gathered numbers. This broadcasts those buffers once from global rank
    0 (so the ranks start equal) and adds their names to the list DDP skips (``_compat.torch_api.DDP_IGNORE_ATTR``),
    which DDP reads when it wraps ``model``. Other buffers (plain, frozen or excluded BatchNorm
    layers, layers synchronised over a sub-group) keep DDP's broadcast.

    **A collective**: every rank must call it, before wrapping ``model`` in DDP. Only acts on gloo
    (CPU); on NCCL the broadcast is cheap and the buffers may not be on their device yet, so it does
    nothing there, nor when not distributed.

    Returns:
        The buffer names added (for :func:`unshare_running_stats`).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return []
    if collectives.backend_for(None, "cpu") != "gloo":
        return []
    world = dist.get_world_size()
    names: list[str] = []
    for prefix, layer in model.named_modules():
        if not isinstance(layer, SyncBatchNorm) or not layer.track_running_stats:
            continue
        group = layer.process_group if layer.process_group is not None else dist.group.WORLD
        if dist.get_world_size(group) != world:
            continue
        for name, buf in layer.named_buffers(recurse=False):
            if buf is not None:
                dist.broadcast(buf, src=0)
                names.append(f"{prefix}.{name}" if prefix else name)
    if names:
        ignored = list(getattr(model, _DDP_IGNORE, []))
        setattr(model, _DDP_IGNORE, ignored + [n for n in names if n not in ignored])
    return names


def unshare_running_stats(model: nn.Module, names: Iterable[str]) -> None:
    """Undo :func:`share_running_stats`: DDP broadcasts those buffers again (from its next wrap on)."""
    drop = set(names)
    if drop and hasattr(model, _DDP_IGNORE):
        kept = [n for n in getattr(model, _DDP_IGNORE) if n not in drop]
        if kept:
            setattr(model, _DDP_IGNORE, kept)
        else:
            delattr(model, _DDP_IGNORE)
