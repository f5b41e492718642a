"""World-size invariance (issue 41): N ranks train the one-process model under ``world_size_invariant=True``.

Fast tier: the plan (every rank's slices of each global batch make the one-process batch), per-sample keyed
randomness, the global batch's dropout masks, the loader checks (no Trainer). Slow tier: launches of
tests/scripts/fit_invariant.py (BatchNorm with sync_batchnorm=True, augmentation in __getitem__, momentum SGD,
1001 shuffled samples, global batch 24, 2 epochs) on 1, 2 and 3 ranks with 0 and 2 workers and dropout 0.3:
final weights within 1e-5 relative, validation accuracy and global_step equal; Lightning's ``ddp`` beside it as
the control (it differs); a resume on another world size continues the same global batches.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, WeightedRandomSampler

from lightning_sync import invariance
from lightning_sync.invariance import (DropoutStep, GlobalBatchSampler, KeyedSampleDataset, SampleKey, dropout_step,
                                       make_dropout_invariant)
from lightning_sync.parts.invariant import invariant_loader
from lightning_sync.seeding import derive_seed
from tests.launch import launch_script

SCRIPT = Path(__file__).parent / "scripts" / "fit_invariant.py"


# ---------------------------------------------------------------- the plan


def _positions(sampler: GlobalBatchSampler) -> list[list[int]]:
    return [[key.sample for key in rows] for rows in sampler]


@pytest.mark.parametrize(("n", "batch", "drop_last"), [(1001, 24, False), (1001, 24, True), (962, 24, False),
                                                       (50, 7, False)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_ranks_slices_of_a_step_make_the_one_process_batch(n: int, batch: int, drop_last: bool,
                                                                 shuffle: bool) -> None:
    one = _positions(GlobalBatchSampler(n, batch, 1, 0, shuffle, seed=7, drop_last=drop_last))
    assert sum(map(len, one)) == (n // batch * batch if drop_last else n)
    for world in (2, 3, 5):
        ranks = [GlobalBatchSampler(n, batch, world, r, shuffle, seed=7, drop_last=drop_last) for r in range(world)]
        per_rank = [_positions(s) for s in ranks]
        assert {len(p) for p in per_rank} == {len(one)}  # the same number of steps on every rank and any N
        for step, expected in enumerate(one):
            sizes = ranks[0].sizes(step)
            real = [per_rank[r][step] for r in range(world) if sizes[r]]
            assert [i for rows in real for i in rows] == expected  # in order, no padding, nothing twice
            assert max(sizes) - min(sizes) <= 1


def test_a_last_global_batch_smaller_than_the_world_gives_stand_ins_weighted_zero() -> None:
    # 962 = 40 * 24 + 2: the last step has 2 samples for 3 ranks
    plans = [GlobalBatchSampler(962, 24, 3, r, True, seed=1, drop_last=False) for r in range(3)]
    last = len(plans[0]) - 1
    assert plans[0].sizes(last) == (1, 1, 0)
    stand_in = plans[2].share(last)
    assert stand_in.shadow and stand_in.loss_scale == 0.0
    assert plans[2].rows(last) == plans[2].rows(last - 1)  # its previous slice again
    assert plans[0].share(last).loss_scale == pytest.approx(3 * 1 / 2)
    assert plans[0].share(0).loss_scale == 1.0
    # 961 samples split among fewer ranks (ddp_sync_ft's live groups): 2 of 3 take the last step's 1 row
    short = GlobalBatchSampler(961, 24, 3, 0, True, seed=1, drop_last=False)
    assert short.sizes(last, 2) == (1, 0) and short.share(last, 2, 1).loss_scale == 0.0
    assert short.rows_among(last, 2, 1) == short.rows_among(last - 1, 2, 1)  # a stand-in, not an empty batch
    assert len(short.rows_among(last, 2, 0)) == 1


def test_the_plan_refuses_what_cannot_be_split() -> None:
    with pytest.raises(ValueError, match="batch_size of at least 4"):
        GlobalBatchSampler(100, 3, 4, 0, True, seed=0, drop_last=False)
    with pytest.raises(ValueError, match="fewer than the 3 ranks"):
        GlobalBatchSampler(2, 8, 3, 0, True, seed=0, drop_last=False)


def test_a_resumed_plan_continues_at_the_same_global_batch_on_any_world_size() -> None:
    one = _positions(GlobalBatchSampler(1001, 24, 1, 0, True, seed=3, drop_last=False))
    for world in (1, 2, 3):
        ranks = [GlobalBatchSampler(1001, 24, world, r, True, seed=3, drop_last=False) for r in range(world)]
        for s in ranks:
            s.resume_at(epoch=0, batches=30)
        per_rank = [_positions(s) for s in ranks]
        assert [sorted(i for p in per_rank for i in p[k]) for k in range(len(per_rank[0]))] == \
            [sorted(b) for b in one[30:]]
    done = GlobalBatchSampler(1001, 24, 2, 0, True, seed=3, drop_last=False)
    done.resume_at(epoch=0, batches=42)  # the epoch was complete: the next one, from its start
    assert (done.epoch, done.first_step) == (1, 0)


# ---------------------------------------------------------------- per-sample randomness


class _Noise(Dataset):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> tuple[float, float, float]:
        import random

        import numpy as np

        return float(torch.rand(())), float(np.random.rand()), random.random()


def test_a_samples_random_numbers_depend_on_root_epoch_and_index_only() -> None:
    data = KeyedSampleDataset(_Noise(), root=11)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    first = data[SampleKey(0, 3)]
    assert torch.equal(torch.get_rng_state(), before)  # the main process's streams did not move
    torch.manual_seed(123)  # whatever the process drew before
    assert data[SampleKey(0, 3)] == first
    assert data[SampleKey(1, 3)] != first and data[SampleKey(0, 4)] != first
    assert KeyedSampleDataset(_Noise(), root=12)[SampleKey(0, 3)] != first
    torch.manual_seed(derive_seed(11, "sample", 0, 3))
    assert first[0] == float(torch.rand(()))  # the documented key
    in_worker = list(DataLoader(data, batch_size=None, sampler=[SampleKey(0, 3)], num_workers=1))
    assert tuple(in_worker[0]) == first  # the same in a worker process


class _SometimesRandom(Dataset):
    """torch noise for every sample; ``random`` for sample 13 only (a conditional augmentation), for sample 21
    with its state put back (as Lightning's ``isolate_rng`` does), and for sample 5 once, cached (fixed label
    noise): each is keyed only if ``random`` is seeded before the sample, whatever was drawn before."""

    def __init__(self) -> None:
        self.cache: dict[int, float] = {}

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> tuple[float, float]:
        import random

        drawn = 0.0
        if i == 13:
            drawn = random.random()
        elif i == 21:
            state = random.getstate()
            drawn = random.random()
            random.setstate(state)
        elif i == 5:
            drawn = self.cache.setdefault(i, random.random())
        return float(torch.rand(())), drawn


@pytest.mark.parametrize("workers", [0, 1])
def test_a_sample_drawing_from_random_is_keyed_in_any_batch_conditional_restoring_or_cached(workers: int) -> None:
    one_by_one = {i: KeyedSampleDataset(_SometimesRandom(), root=7)[SampleKey(2, i)] for i in range(32)}
    assert all(one_by_one[i][1] != 0.0 for i in (5, 13, 21))
    batches = [list(range(20, 32)), list(range(8, 20)), list(range(0, 8))]
    loader = DataLoader(KeyedSampleDataset(_SometimesRandom(), root=7),
                        batch_sampler=[[SampleKey(2, i) for i in b] for b in batches], num_workers=workers,
                        collate_fn=lambda samples: samples)
    drawn = {i: tuple(sample) for b, batch in zip(batches, loader) for i, sample in zip(b, batch)}
    assert drawn == one_by_one


class _TorchOnly(_Noise):
    keyed_generators = ("torch",)


def test_a_data_set_declaring_its_generators_has_only_those_seeded() -> None:
    import random

    import numpy as np

    data = KeyedSampleDataset(_TorchOnly(), root=11)
    assert data.generators == ("torch",)
    assert invariance.keyed_generators(_Noise()) == ("torch", "numpy", "random")
    first, again = data[SampleKey(0, 3)], data[SampleKey(0, 3)]
    assert first[0] == again[0] == KeyedSampleDataset(_Noise(), root=11)[SampleKey(0, 3)][0]  # torch: keyed
    assert first[1:] != again[1:]  # numpy and random: the process's running streams, not reseeded
    random.seed(5)
    np.random.seed(5)
    data[SampleKey(0, 4)]
    assert (random.random(), np.random.rand()) != (random.Random(5).random(), np.random.RandomState(5).rand())
    # wrappers: a Subset reads its data set's; a ConcatDataset the union of its parts'
    assert invariance.keyed_generators(torch.utils.data.Subset(_TorchOnly(), [1, 2])) == ("torch",)
    mixed = torch.utils.data.ConcatDataset([_TorchOnly(), _Noise()])
    assert invariance.keyed_generators(mixed) == ("torch", "numpy", "random")
    nothing = type("Nothing", (_Noise,), {"keyed_generators": ()})()
    assert KeyedSampleDataset(nothing, root=1).generators == () and invariance._seeder(()) is None
    listed = _Noise()
    listed.keyed_generators = ["random", "torch"]  # type: ignore[attr-defined]  # on the object (a HF data set's way)
    keyed = KeyedSampleDataset(listed, root=1)
    assert keyed.generators == ("torch", "random") and keyed.declared_by == "_Noise.keyed_generators"
    for bad, says in (("torch", "type str is not a tuple, list or set of them"),
                      (("torch", "cuda"), "'cuda' is not one of them"),
                      ([["torch"]], r"\['torch'\] is not one of them"),
                      (3, "type int is not"), (None, r"None is not a collection of them \(for none, give \(\)\)"),
                      ({"torch": 1}, "type dict is not")):
        wrong = type("Wrong", (_Noise,), {"keyed_generators": bad})()
        with pytest.raises(ValueError, match=r"Wrong.keyed_generators = .*out of \('torch', 'numpy', 'random'\) "
                                             rf".*{says}"):
            KeyedSampleDataset(wrong, root=1)


class _Columns(Dataset):
    """Answers unknown attribute names from its columns (a KeyError where there is none, as some do)."""

    def __init__(self, inner: Any = None) -> None:
        self.columns = {"x": [1.0, 2.0]}
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name in ("columns", "inner") or name.startswith("__"):
            raise AttributeError(name)
        if self.inner is not None:
            return getattr(self.inner, name)
        return self.columns[name]

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> float:
        return self.columns["x"][i]


def test_who_declared_the_generators_is_said_and_odd_getattrs_mean_all_three() -> None:
    assert KeyedSampleDataset(_Columns(), root=1).generators == invariance.GENERATORS  # its KeyError: not declared
    forwarded = KeyedSampleDataset(_Columns(_TorchOnly()), root=1)
    assert forwarded.generators == ("torch",)
    assert forwarded.declared_by == ("_Columns.keyed_generators (forwarded by its __getattr__ from the data set it "
                                     "wraps)")
    mixed = KeyedSampleDataset(torch.utils.data.ConcatDataset([_TorchOnly(), _Noise()]), root=1)
    assert mixed.declared_by == "its parts' (_Noise (no keyed_generators: all three), _TorchOnly.keyed_generators)"
    assert KeyedSampleDataset(torch.utils.data.Subset(_TorchOnly(), [0]), root=1).declared_by == \
        "_TorchOnly.keyed_generators"
    assert KeyedSampleDataset(_Noise(), root=1).declared_by is None


@pytest.mark.parametrize("workers", [0, 1])
def test_the_checkers_runs_note_samples_drawing_from_unkeyed_generators(workers: int, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(invariance.CHECK_DRAWS_ENV, str(tmp_path))
    declared = type("Declared", (_Noise,), {"keyed_generators": ("torch", "random")})()
    loader = DataLoader(KeyedSampleDataset(declared, root=3), batch_sampler=[[SampleKey(0, 2), SampleKey(0, 7)]],
                        num_workers=workers, collate_fn=lambda samples: samples)
    assert len(list(loader)) == 1
    lines = sorted(line for path in tmp_path.glob("draws-*.txt") for line in path.read_text().splitlines())
    assert lines == ["numpy 2 unkeyed", "numpy 7 unkeyed", "random 2 keyed", "random 7 keyed", "torch 2 keyed",
                     "torch 7 keyed"]  # each sample drew from all three; numpy is not declared


# ---------------------------------------------------------------- dropout


def _mask(layer: nn.Module, step: DropoutStep, rows: int, shape: tuple[int, ...]) -> torch.Tensor:
    with dropout_step(step):
        return layer(torch.ones(rows, *shape))


@pytest.mark.parametrize(("kind", "shape"), [(nn.Dropout, (5,)), (nn.Dropout, (3, 4)), (nn.Dropout2d, (4, 3, 3)),
                                             (nn.Dropout1d, (4, 6))])
def test_the_dropout_mask_of_a_sample_does_not_depend_on_the_world_size(kind: type, shape: tuple[int, ...]) -> None:
    model = nn.Sequential(nn.Linear(2, 2), kind(0.3))
    converted, left = make_dropout_invariant(model)
    assert converted == ["1"] and left == [] and isinstance(model[1], kind)
    layer = model[1]
    whole = _mask(layer, DropoutStep(root=5, epoch=0, step=3, rows=10, offset=0, local=10), 10, shape)
    assert 0 < int((whole == 0).sum()) < whole.numel()
    for sizes in ((5, 5), (4, 3, 3)):
        parts = [_mask(layer, DropoutStep(root=5, epoch=0, step=3, rows=10, offset=sum(sizes[:r]), local=n), n, shape)
                 for r, n in enumerate(sizes)]
        assert torch.equal(torch.cat(parts), whole)
    if kind is not nn.Dropout:  # one draw per (sample, channel)
        flat = whole.flatten(2)
        assert torch.equal(flat.amin(-1), flat.amax(-1))
    other = _mask(layer, DropoutStep(root=5, epoch=0, step=4, rows=10, offset=0, local=10), 10, shape)
    assert not torch.equal(other, whole)
    layer.eval()
    assert torch.equal(_mask(layer, DropoutStep(5, 0, 3, 10, 0, 10), 10, shape), torch.ones(10, *shape))


def _splitmix64(key: int, i: int) -> int:
    """SplitMix64's output for counter ``i`` under ``key``: the reference, in Python integers."""
    bits = (1 << 64) - 1
    z = (key + i * 0x9E3779B97F4A7C15) & bits
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & bits
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & bits
    return z ^ (z >> 31)


@pytest.mark.parametrize("key", [0, 12345, -(1 << 63), (1 << 63) - 1, -987654321987654321])
def test_the_keep_mask_is_splitmix64_in_any_chunks_and_keeps_one_minus_p(key: int,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    start, p = (1 << 40) + 7, 0.3
    mask = invariance._keep_mask(key, start, (6, 50), p)
    threshold = round(p * 2.0**64)
    expected = [float(_splitmix64(key % (1 << 64), start + i) >= threshold) for i in range(300)]
    assert mask.flatten().tolist() == expected  # int64 arithmetic wraps as the reference's modulo 2**64
    monkeypatch.setitem(invariance._CHUNK, "cpu", 7)  # chunk bounds inside rows change nothing
    assert torch.equal(invariance._keep_mask(key, start, (6, 50), p, dtype=torch.float64), mask.double())
    monkeypatch.undo()
    big = invariance._keep_mask(key, 0, (1000, 1000), p, dtype=torch.bool)
    assert abs(big.float().mean().item() - (1 - p)) < 0.002  # 1e6 draws: the rate's sd is 4.6e-4
    same = (big[:, 1:] == big[:, :-1]).float().mean().item()  # neighbours independent: p^2 + (1-p)^2 equal
    assert abs(same - (p * p + (1 - p) ** 2)) < 0.002
    for tiny in (1e-6, 0.999999):  # the threshold has 64 bits: tiny probabilities are not rounded to 0 or 1
        assert abs(invariance._keep_mask(key, 0, (1000, 1000), tiny, dtype=torch.bool).float().mean().item()
                   - (1 - tiny)) < 1e-5


def test_a_stand_in_steps_dropout_draws_nothing_from_the_global_generator() -> None:
    layer = nn.Dropout(0.5)
    make_dropout_invariant(layer)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with dropout_step(DropoutStep(root=1, epoch=0, step=9, rows=1, offset=0, local=0)):  # this rank: a stand-in
        out = layer(torch.ones(4, 3))
    assert torch.equal(torch.get_rng_state(), before) and 0 < int((out == 0).sum()) < out.numel()


def test_a_dropout_input_without_the_batch_first_is_refused_and_layers_can_opt_out() -> None:
    model = nn.Sequential(nn.Dropout(0.5), nn.Dropout(0.5), nn.AlphaDropout(0.2))
    model[1].world_size_invariant = False
    converted, left = make_dropout_invariant(model)
    assert converted == ["0"] and left == ["1 (marked world_size_invariant = False)",
                                           "2 (AlphaDropout: no invariant form; remove it, or accept per-rank masks)"]
    with dropout_step(DropoutStep(root=0, epoch=0, step=0, rows=8, offset=0, local=4)), \
            pytest.raises(RuntimeError, match=r"dropout layer '0' got an input of shape \(7, 4\).*batch_first"):
        model[0](torch.ones(7, 4))


@pytest.mark.slow  # Inductor's compile: ~15 s
@pytest.mark.timeout(300)
def test_torch_compile_of_a_model_with_invariant_dropout_draws_eagers_masks() -> None:
    # Inductor folded the hash's wrapping int64 products as unbounded integers ("too big to convert to int64_t"):
    # the mask is computed eagerly (torch.compiler.disable), the step read at every call, not frozen in a graph
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.ReLU(), nn.Linear(32, 1))
    make_dropout_invariant(model)
    compiled = torch.compile(model)
    x = torch.randn(6, 8)
    for step, offset in ((3, 6), (3, 0), (4, 6)):
        grads = []
        for run in (model, compiled):
            model.zero_grad()
            with dropout_step(DropoutStep(root=1, epoch=0, step=step, rows=12, offset=offset, local=6)):
                out = run(x)
            out.square().sum().backward()
            grads.append([out.detach(), *(p.grad.clone() for p in model.parameters())])
        assert all(torch.equal(a, b) for a, b in zip(*grads)), (step, offset)
    # the step is read outside the graphs: later steps, other call counts, no recompilation
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(5, 12):
            with dropout_step(DropoutStep(root=1, epoch=0, step=step, rows=12, offset=6, local=6)):
                for _ in range(step % 3 + 1):
                    compiled(x)


def test_masks_are_keyed_by_the_unwrapped_models_layer_names() -> None:
    # torch.compile and checkpoint_wrapper put a level into the path ("_orig_mod", "_checkpoint_wrapped_module"):
    # a model wrapped before conversion draws the masks of the same model unwrapped
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from lightning_sync.invariance import checkpoint_context

    def model(wrap: Any) -> nn.Module:
        torch.manual_seed(0)
        block = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5))
        return nn.Sequential(wrap(block), nn.Dropout(0.5), nn.Linear(32, 1))

    x = torch.randn(6, 8)
    outs = []
    for wrap in (lambda m: m, lambda m: torch.compile(m, backend="eager"),
                 lambda m: checkpoint_wrapper(m, context_fn=checkpoint_context)):
        m = model(wrap)
        make_dropout_invariant(m)
        with dropout_step(DropoutStep(root=4, epoch=0, step=2, rows=9, offset=3, local=6)):
            outs.append(m(x))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_unbatched_inputs_to_channel_dropout_are_refused_as_torch_reads_them() -> None:
    model = nn.ModuleDict({"d1": nn.Dropout1d(0.5), "d2": nn.Dropout2d(0.5), "d3": nn.Dropout3d(0.5)})
    make_dropout_invariant(model)
    with dropout_step(DropoutStep(root=0, epoch=0, step=0, rows=8, offset=0, local=4)):
        for name, shape in (("d1", (4, 6)), ("d3", (4, 2, 3, 3))):  # torch: one sample, (C, L) / (C, D, H, W)
            with pytest.raises(RuntimeError, match=rf"'{name}' \(Dropout[13]d\) got a {len(shape)}-D input.*batch"):
                model[name](torch.ones(shape))
        assert model["d1"](torch.ones(4, 6, 5)).shape == (4, 6, 5)
        out = model["d2"](torch.ones(4, 6, 5))  # torch reads a 3-D input of Dropout2d as (N, C, L) (and warns)
        assert torch.equal(out.amin(-1), out.amax(-1)) and 0 < int((out == 0).sum()) < out.numel()


def _grads(model: nn.Module, x: torch.Tensor, run: Any) -> list[torch.Tensor]:
    model.zero_grad()
    with dropout_step(DropoutStep(root=2, epoch=1, step=7, rows=6, offset=2, local=4)):
        run(model, x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def _capture(errors: list[BaseException], fn: Any) -> None:
    try:
        fn()
    except BaseException as err:  # noqa: BLE001 - handed to the test's thread
        errors.append(err)


def test_activation_checkpointing_recomputes_the_forwards_masks_with_the_context_and_refuses_without() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import checkpoint

    from lightning_sync.invariance import checkpoint_context

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(5, 16), nn.Dropout(0.5), nn.ReLU())
    model = nn.ModuleList([block, nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 1)])
    make_dropout_invariant(model)

    def plain(m: nn.Module, x: torch.Tensor) -> torch.Tensor:  # block twice (shared weights and dropout layer)
        h = m[1](m[0](x))
        return m[3](m[2](m[0](h[:, :5]) + h))

    def segments(m: nn.Module, x: torch.Tensor) -> torch.Tensor:  # two segments, one of them holding both calls
        h = checkpoint(lambda t: m[1](m[0](t)), x, use_reentrant=False, context_fn=checkpoint_context)
        h = checkpoint(lambda t: m[2](m[0](t[:, :5]) + t), h, use_reentrant=False, context_fn=checkpoint_context)
        return m[3](h)

    x = torch.randn(4, 5)
    expected = _grads(model, x, plain)
    assert all(torch.equal(a, b) for a, b in zip(_grads(model, x, segments), expected))
    wrapped = nn.ModuleList([checkpoint_wrapper(block, context_fn=checkpoint_context), *model[1:]])
    assert all(torch.equal(a, b) for a, b in zip(_grads(wrapped, x, plain), expected))
    # backward on another thread (as CUDA's autograd device threads run it): the step is not in that thread's context
    model.zero_grad()
    with dropout_step(DropoutStep(root=2, epoch=1, step=7, rows=6, offset=2, local=4)):
        loss = segments(model, x).square().sum()
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: _capture(errors, loss.backward))
    thread.start()
    thread.join(60)
    assert not errors and all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))
    for reentrant in (False, True):  # without the context: an error, not new masks
        with pytest.raises(RuntimeError, match=r"dropout layer '0.1' ran again during backward.*context_fn="):
            _grads(model, x.clone().requires_grad_(), lambda m, t: m[3](checkpoint(m[0], t, use_reentrant=reentrant)))


def test_the_checkers_forward_hooks_name_the_innermost_module_that_drew() -> None:
    from lightning_sync.testing import _ForwardDraws

    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.ReLU(), nn.Dropout(0.5)), nn.Linear(3, 3))
    draws = _ForwardDraws(model)
    model(torch.ones(4, 3))
    assert draws.take() == ["1.1"]  # not its parent "1", whose forward holds it
    model.eval()
    model(torch.ones(4, 3))
    assert draws.take() == []
    draws.remove()
    model.train()
    model(torch.ones(4, 3))
    assert draws.take() == []


# ---------------------------------------------------------------- the loader checks


class _Stream(IterableDataset):
    def __iter__(self):
        yield from range(4)


def test_loaders_whose_one_process_order_is_unknown_are_refused() -> None:
    data = list(range(20))
    with pytest.raises(ValueError, match="map-style training set"):
        invariant_loader(DataLoader(_Stream(), batch_size=2), 2, 0, 0, 0)
    with pytest.raises(ValueError, match="sampler is WeightedRandomSampler, a sampler of your own"):
        invariant_loader(DataLoader(data, batch_size=4, sampler=WeightedRandomSampler([1.0] * 20, 20)), 2, 0, 0, 0)
    with pytest.raises(ValueError, match="batch sampler of its own"):
        invariant_loader(DataLoader(data, batch_sampler=[[0, 1], [2, 3]]), 2, 0, 0, 0)
    loader = invariant_loader(DataLoader(data, batch_size=6, shuffle=False), 2, 1, 0, 0)
    assert [b.tolist() for b in loader] == [[3, 4, 5], [9, 10, 11], [15, 16, 17], [19]]
    assert len(loader) == 4


# ---------------------------------------------------------------- real fits


def _fit(tmp_path: Path, tag: str, *args: str) -> dict:
    out = tmp_path / tag
    proc = launch_script(SCRIPT, out, *args, timeout=240)
    return {**torch.load(out / "rank0.pt"), "stderr": proc.stderr}


def _relative_gap(a: dict, b: dict) -> float:
    floats = [k for k, v in a["weights"].items() if v.is_floating_point()]
    gap = max(float((a["weights"][k] - b["weights"][k]).abs().max()) for k in floats)
    return gap / max(float(a["weights"][k].abs().max()) for k in floats)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_and_three_ranks_train_the_one_process_model(tmp_path: Path) -> None:
    one = _fit(tmp_path, "one", "--devices", "1")
    two = _fit(tmp_path, "two", "--devices", "2")
    three = _fit(tmp_path, "three", "--devices", "3")
    for run in (two, three):
        assert _relative_gap(one, run) < 1e-5
        assert run["val_acc"] == one["val_acc"] and run["global_step"] == one["global_step"] == 84
    # Lightning's ddp on the same module, per-rank batch 24 // N: the control
    ddp_one = _fit(tmp_path, "ddp_one", "--devices", "1", "--strategy", "ddp")
    ddp_two = _fit(tmp_path, "ddp_two", "--devices", "2", "--strategy", "ddp")
    assert _relative_gap(ddp_one, ddp_two) > 1e-2
    # BatchNorm left per rank: warned at set-up, and the run differs
    unsynced = _fit(tmp_path, "unsynced", "--devices", "2", "--no-sync-bn")
    assert "BatchNorm layers net.1 normalise by each rank's slice" in unsynced["stderr"]
    assert "Trainer(sync_batchnorm=True)" in unsynced["stderr"] and "BatchNorm layers" not in two["stderr"]
    assert _relative_gap(one, unsynced) > 1e-3


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dropout_workers_and_stand_ins_keep_the_one_process_model(tmp_path: Path) -> None:
    one = _fit(tmp_path, "one", "--devices", "1", "--dropout", "0.3")
    two = _fit(tmp_path, "two_w2", "--devices", "2", "--dropout", "0.3", "--workers", "2")
    assert _relative_gap(one, two) < 1e-5 and two["val_acc"] == one["val_acc"]
    # 962 samples: the last global batch has 2 samples for 3 ranks (rank 2 runs a stand-in step)
    short_one = _fit(tmp_path, "short_one", "--devices", "1", "--dropout", "0.3", "--samples", "962")
    short_three = _fit(tmp_path, "short_three", "--devices", "3", "--dropout", "0.3", "--samples", "962",
                       "--workers", "2")
    assert _relative_gap(short_one, short_three) < 1e-5 and short_three["val_acc"] == short_one["val_acc"]
    assert short_three["global_step"] == short_one["global_step"] == 82


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_resume_on_another_world_size_continues_the_same_global_batches(tmp_path: Path) -> None:
    one = _fit(tmp_path, "one", "--devices", "1", "--dropout", "0.3")
    launch_script(SCRIPT, tmp_path / "stopped", "--devices", "2", "--dropout", "0.3", "--stop-after", "30",
                  timeout=240)
    ckpt = tmp_path / "stopped" / "last.ckpt"
    assert torch.load(ckpt, weights_only=False)["lightning_sync"]["world_size_invariant"]["batches"] == 30
    three = _fit(tmp_path, "three", "--devices", "3", "--dropout", "0.3", "--resume", str(ckpt))
    assert _relative_gap(one, three) < 1e-5 and three["val_acc"] == one["val_acc"]
    assert three["global_step"] == 84


# ---------------------------------------------------------------- the checker


def _record(losses: list[float], norms: list[float], weight: float) -> dict:
    return {"losses": [(0, i, loss, 4) for i, loss in enumerate(losses)], "grad_norms": norms,
            "weights": {"w": torch.tensor([weight, 1.0], dtype=torch.float64)}, "metrics": {}, "step_metrics": []}


def test_weights_apart_while_every_step_agrees_is_named_as_the_optimizers_amplification() -> None:
    """AdamW on a user's conv net: every step's loss and gradient agreed within 1.5e-7 on 1 and 2 ranks, the
    weights after 20 steps 1.2e-2 apart (SGD on the same module: 5e-7)."""
    from lightning_sync.testing import compare_runs

    one = [_record([0.7, 0.6], [1.0, 0.9], 0.50)]
    two = [_record([0.7, 0.6], [1.0, 0.9], 0.51), _record([0.7, 0.6], [1.0, 0.9], 0.51)]
    report = compare_runs({1: one, 2: two}, rtol=1e-5)
    assert not report.ok and report.first_difference == "the final weights differ by 1.0e-02 of their largest value"
    assert len(report.causes) == 1 and "the optimizer amplifies the all-reduce's float rounding" in report.causes[0]
    assert compare_runs({1: one, 2: two}, rtol=1e-5, weights_rtol=0.05).ok
    stepped = [_record([0.7, 0.61], [1.0, 0.9], 0.51), _record([0.7, 0.61], [1.0, 0.9], 0.51)]
    differs = compare_runs({1: one, 2: stepped}, rtol=1e-5, weights_rtol=0.05)
    assert not differs.ok and differs.first_difference.startswith("step 1 (epoch 0, batch 1): the global batch's loss")


def test_samples_drawing_from_unkeyed_generators_fail_the_check_even_where_no_step_differed() -> None:
    """A declaration missing a generator whose draws happened to change nothing in the checked steps (a crop offset
    drawn on images already of the crop's size) is still wrong: the report fails and names it."""
    from lightning_sync.testing import compare_runs

    one = [{**_record([0.7, 0.6], [1.0, 0.9], 0.50), "unkeyed_draws": [("random", 0), ("random", 4)],
            "keyed_by": "Crops.keyed_generators"}]
    two = [_record([0.7, 0.6], [1.0, 0.9], 0.50), _record([0.7, 0.6], [1.0, 0.9], 0.50)]
    report = compare_runs({1: one, 2: two}, rtol=1e-5)
    assert not report.ok and "no step differed within rtol" in (report.first_difference or "")
    assert len(report.causes) == 1 and "drew from random's global generator (sample(s) 0, 4), which " \
        "Crops.keyed_generators leaves unseeded" in report.causes[0], report
    assert "Fix: add 'random' to Crops.keyed_generators" in report.causes[0]
    assert compare_runs({1: [_record([0.7, 0.6], [1.0, 0.9], 0.50)], 2: two}, rtol=1e-5).ok


def test_a_passing_check_says_which_generators_the_samples_need_seeded() -> None:
    from lightning_sync.testing import compare_runs

    def runs(**first: Any) -> dict[int, list[dict[str, Any]]]:
        same = _record([0.7, 0.6], [1.0, 0.9], 0.50)
        return {1: [{**same, **first}], 2: [same, same]}

    report = compare_runs(runs(keyed_generators=("torch", "numpy", "random"), keyed_used=["torch"], keyed_by=None,
                               train_set="Points"), rtol=1e-5)
    assert report.ok and len(report.tips) == 1, report
    assert "the training samples drew only from torch's generator in these runs (torch's, numpy's, random's " \
        "seeded before each): keyed_generators = ('torch',) on the Points class seeds only" in report.tips[0]
    assert str(report).splitlines()[1] == f"  tip: {report.tips[0]}"
    none = compare_runs(runs(keyed_generators=("torch", "random"), keyed_used=[], keyed_by="Crops.keyed_generators",
                             train_set="Crops"), rtol=1e-5)
    assert "drew from none of the global generators" in none.tips[0] and "Crops.keyed_generators = ()" in none.tips[0]
    assert compare_runs(runs(keyed_generators=("torch",), keyed_used=["torch"], train_set="P"), rtol=1e-5).tips == []
    assert compare_runs(runs(), rtol=1e-5).tips == []  # nothing recorded (an older record): no tip


CASES = "tests.invariance_cases"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gradient_accumulation_and_clipping_keep_the_one_process_model() -> None:
    # 8 optimizer steps of 3 global batches of 12 (17 an epoch: an accumulation cut short at the epoch's end), the
    # gradient norm clipped to 0.05 (below the norms here: every step clipped), per-step losses of every micro-batch
    from lightning_sync.testing import check_world_size_invariance

    report = check_world_size_invariance(f"{CASES}:good", f"{CASES}:train_loader", world_sizes=(1, 2), max_steps=8,
                                         sync_batchnorm=True, accumulate_grad_batches=3, gradient_clip_val=0.05)
    assert report.ok and max(report.gaps[2].values()) < 1e-5, report


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_checker_passes_an_invariant_module_with_validation(tmp_path: Path) -> None:
    # 203 samples in global batches of 12: step 16 splits 11 samples 6/5 (the loss and the per-step
    # sync_dist mean weighted by the slices), then the second epoch
    from lightning_sync.testing import assert_world_size_invariant

    # (a validation loss every 5 steps over 61 samples, 31/30 a rank: the same on 1 and 2 ranks, the validation
    # set drawing nothing while loading; with augmentation it differs: the doctor test below)
    report = assert_world_size_invariant(f"{CASES}:validated", f"{CASES}:train_loader", f"{CASES}:val_plain_loader",
                                         world_sizes=(1, 2), max_steps=20, sync_batchnorm=True, val_check_interval=5)
    assert report.ok and report.causes == [] and set(report.gaps[2]) == {"loss", "grad_norm", "weights", "metrics"}
    assert max(report.gaps[2].values()) < 1e-5 and str(report).startswith("world-size invariance: OK (1 rank vs 2")
    # Points draws from torch's generator only: the report says which declaration seeds just that
    assert len(report.tips) == 1 and "keyed_generators = ('torch',) on the Points class" in report.tips[0], report


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("model", "data", "kwargs", "first", "cause"), [
    ("good", "train_loader", {}, "step 0 (epoch 0, batch 0): the global batch's loss",
     "BatchNorm layers without synchronised statistics (net.1)"),
    ("own_noise", "train_loader", {"sync_batchnorm": True}, "step 0",
     ("drew from the global random generators (torch) at step(s) 0, 1",
      ": torch's in training_step itself, outside any submodule's forward")),
    ("forward_noise", "train_loader", {"sync_batchnorm": True}, "step 0",
     ("drew from the global random generators (torch) at step(s) 0, 1",
      ": torch's in the forward of net.3 (F.dropout, torch.rand or a dropout layer left per rank there)")),
    ("summed_loss", "train_loader", {"sync_batchnorm": True}, "on 1 rank, 3.",
     "the loss is summed over the batch"),
    ("log_unsynced", "train_loader", {"sync_batchnorm": True}, "logged metric 'train_loss'",
     "metric 'train_loss' differs across the 2 ranks (rank 0: "),
    ("good", "numpy_undeclared_loader", {"sync_batchnorm": True}, "step 0",
     ("the training set's __getitem__ drew from numpy's global generator (sample(s) ",
      "which _TorchOnlyDeclared.keyed_generators leaves unseeded", "Fix: add 'numpy' to _TorchOnlyDeclared.")),
    ("good", "weighted_loader", {"sync_batchnorm": True}, "a run did not complete",
     "the 1-rank run (rank 0) and the 2-rank run (rank 0) stopped: ValueError: world_size_invariant=True: the "
     "training loader's sampler is a sampler of your own (Lightning wrapped it in DistributedSamplerWrapper)"),
])
def test_the_checker_names_each_broken_variants_cause(model: str, data: str, kwargs: dict, first: str,
                                                      cause: str | tuple[str, ...]) -> None:
    from lightning_sync.testing import assert_world_size_invariant, check_world_size_invariance

    report = check_world_size_invariance(f"{CASES}:{model}", f"{CASES}:{data}", world_sizes=(1, 2), max_steps=6,
                                         **kwargs)
    assert not report.ok
    assert first in (report.first_difference or ""), report
    parts = cause if isinstance(cause, tuple) else (cause,)
    assert len(report.causes) == 1 and all(part in report.causes[0] for part in parts), report
    assert "Fix:" in report.causes[0] or "Use shuffle=True" in report.causes[0]
    text = str(report)
    assert text.startswith("world-size invariance: FAILED (1 rank vs 2 ranks)") and all(part in text for part in parts)
    if model == "summed_loss":  # the pytest assertion carries the same text
        with pytest.raises(AssertionError, match="the loss is summed over the batch"):
            assert_world_size_invariant(f"{CASES}:{model}", f"{CASES}:{data}", world_sizes=(1, 2), max_steps=2,
                                        **kwargs)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lsync_doctor_invariance_prints_the_report_and_exits_nonzero_on_a_difference(tmp_path: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "lightning_sync.doctor", "invariance", f"{CASES}:good",
                           f"{CASES}:train_loader", "--world-sizes", "1,2", "--max-steps", "4"],
                          capture_output=True, text=True, timeout=280, cwd=Path(__file__).parents[1])
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "world-size invariance: FAILED (1 rank vs 2 ranks)" in proc.stdout
    assert "Trainer(sync_batchnorm=True)" in proc.stdout
    # Trainer arguments from the command: the BatchNorm is synchronised, validation runs every 3 steps; the
    # validation set draws its augmentation unkeyed, so only the logged validation loss differs, and is named so
    proc = subprocess.run([sys.executable, "-m", "lightning_sync.doctor", "invariance", f"{CASES}:validated",
                           f"{CASES}:train_loader", f"{CASES}:val_loader", "--world-sizes", "1,2", "--max-steps", "6",
                           "--sync-batchnorm", "--trainer", "val_check_interval=3"],
                          capture_output=True, text=True, timeout=280, cwd=Path(__file__).parents[1])
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "logged metric 'val_loss' is " in proc.stdout, proc.stdout
    assert "only logged metrics differ" in proc.stdout and "validation set" in proc.stdout
    assert "BatchNorm" not in proc.stdout


def test_the_checker_names_a_factory_it_cannot_import_before_any_run() -> None:
    import subprocess
    import sys

    from lightning_sync.testing import check_world_size_invariance

    with pytest.raises(ValueError, match="model_factory='tests.invariance_cases:goood' cannot be imported: "
                                         "AttributeError"):
        check_world_size_invariance(f"{CASES}:goood", f"{CASES}:train_loader")
    proc = subprocess.run([sys.executable, "-m", "lightning_sync.doctor", "invariance", "tests.invariance_cases",
                           f"{CASES}:train_loader"], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[1])
    assert proc.returncode == 2 and "use 'module:function'" in proc.stderr and "Traceback" not in proc.stderr
    with pytest.raises(ValueError, match=r"Trainer argument\(s\) devices, strategy are the checker's own"):
        check_world_size_invariance(f"{CASES}:good", f"{CASES}:train_loader", devices=2, strategy="ddp")
    proc = subprocess.run([sys.executable, "-m", "lightning_sync.doctor", "invariance", f"{CASES}:good",
                           f"{CASES}:train_loader", "--trainer", "timeout=3"], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parents[1])
    assert proc.returncode == 2 and "timeout is not a Trainer argument but the checker's own (--timeout)" in proc.stderr


@pytest.mark.slow
@pytest.mark.serial  # mostly a wait for the timeout, which the other worker's tests fill; 60 s leaves a loaded
# machine time for the 1-rank run and both ranks' start
@pytest.mark.timeout(300)
def test_the_checker_ends_every_process_of_a_run_that_hangs_and_says_so(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import time

    from lightning_sync.testing import check_world_size_invariance

    monkeypatch.setenv("LSYNC_TEST_PIDS", str(tmp_path))
    report = check_world_size_invariance(f"{CASES}:hangs_on_rank1", f"{CASES}:train_loader", world_sizes=(1, 2),
                                         max_steps=6, sync_batchnorm=True, timeout=60)
    assert not report.ok and report.first_difference == "a run did not complete"
    assert report.causes == ["the 2-rank run stopped: it did not finish within 60 s (timeout=), so every process of "
                             "it was ended; rank(s) 0, 1 had not ended their fit: a rank waiting in a collective the "
                             "others never reach (a hang), or a run slower than the timeout allows"], report
    pids = {p.name: int(p.read_text()) for p in tmp_path.iterdir()}
    assert set(pids) == {"1-0", "2-0", "2-1"}

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [name for name, pid in pids.items() if alive(pid)], "a rank of the stopped run is still running"
    assert os.getpid() not in pids.values()


def test_the_checker_refuses_factories_new_processes_cannot_import() -> None:
    from lightning_sync.testing import check_world_size_invariance

    with pytest.raises(ValueError, match="not an importable function"):
        check_world_size_invariance(lambda: None, f"{CASES}:train_loader")
    with pytest.raises(ValueError, match="give two or more sizes"):
        check_world_size_invariance(f"{CASES}:good", f"{CASES}:train_loader", world_sizes=(2,))
    with pytest.raises(ValueError, match="use 'module:function'"):
        check_world_size_invariance("good", f"{CASES}:train_loader")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp2_under_model_parallel_sync_trains_the_one_process_model(tmp_path: Path) -> None:
    """SyncModelParallelStrategy(world_size_invariant=True): FSDP2 over the data-parallel ranks (LayerNorm: no
    SyncBatchNorm under FSDP2), dropout 0.3; the full weights gathered on rank 0."""
    one = _fit(tmp_path, "one", "--devices", "1", "--strategy", "fsdp", "--dropout", "0.3")
    three = _fit(tmp_path, "three", "--devices", "3", "--strategy", "fsdp", "--dropout", "0.3")
    assert _relative_gap(one, three) < 1e-5 and three["val_acc"] == one["val_acc"]
    assert three["global_step"] == one["global_step"] == 84


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_mid_epoch_checkpoint_resumed_with_the_other_setting_says_so(tmp_path: Path) -> None:
    invariant = tmp_path / "invariant"
    launch_script(SCRIPT, invariant, "--devices", "2", "--stop-after", "10", timeout=240)
    without = _fit(tmp_path, "without", "--devices", "2", "--per-rank", "--resume", str(invariant / "last.ckpt"))
    assert ("resume: the checkpoint was written with world_size_invariant=True, after 10 global batches of 24 in "
            "epoch 0; this run has world_size_invariant=False" in without["stderr"]), without["stderr"][-3000:]
    per_rank = tmp_path / "per_rank"
    launch_script(SCRIPT, per_rank, "--devices", "2", "--per-rank", "--stop-after", "10", timeout=240)
    refused = launch_script(SCRIPT, tmp_path / "refused", "--devices", "2", "--resume", str(per_rank / "last.ckpt"),
                            timeout=240, check=False)
    assert refused.returncode != 0
    assert ("resume: the checkpoint was written mid-epoch with world_size_invariant=False" in refused.stderr
            ), refused.stderr[-3000:]
