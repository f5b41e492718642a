"""The gpu tier: every CUDA and NCCL path that one GPU can reach (``pytest -m gpu``;
``bash scripts/gpu_check.sh`` installs what it needs and runs it on a bare CUDA machine).

NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so NCCL runs here with a world of one:
the public collectives (which return their input there), the transport they use on more ranks (the
metadata exchange, the padded byte exchange, the gather to one rank, objects with CUDA tensors), the
collective guard around NCCL work, the NCCL barrier and teardown, torch's CUDA SyncBatchNorm kernels,
world-size-invariant dropout's masks (the CPU ones).
Two ranks share the GPU over gloo with CUDA tensors: uneven gathers, seeds, the portable SyncBatchNorm.
The Trainer runs on ``accelerator="gpu", devices=1`` with NCCL: native SyncBatchNorm, bf16-mixed,
a bit-exact mid-epoch resume (dropout draws from the CUDA generator), ValidationGather and
PredictionWriter with CUDA outputs, ``lsync-train trainer=gpu_ddp``, and SyncModelParallelStrategy
(FSDP2 over NCCL) with exact evaluation and a bit-exact resume.

Everywhere without CUDA every test here is skipped with the reason "no CUDA device".
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.distributed import run_ranks
from tests.launch import launch_script

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

SCRIPTS = Path(__file__).parent / "scripts"
C = 3  # BatchNorm channels
STEPS = 3
TOL = 1e-5


def _cpu(obj: Any) -> Any:
    """``obj`` with every tensor moved to the host (the parent compares on CPU), devices noted."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


# ------------------------------------------------------------------ NCCL, a world of one


def _nccl_world_of_one(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    import lightning_sync as ls
    from lightning_sync import _pickling as P_
    from lightning_sync import collectives as C_
    from lightning_sync._compat.torch_api import TorchSyncBatchNormFunction
    from lightning_sync.guard import CollectiveGuard

    assert dist.get_backend() == "nccl" and world == 1
    cuda = torch.device("cuda", torch.cuda.current_device())
    out: dict[str, Any] = {"devices": {}}
    # the public functions: a world of one returns the input (on its device)
    t = torch.arange(4.0, device=cuda)
    out["all_reduce"] = ls.collectives.all_reduce(t.clone(), op="mean")
    rows, counts = ls.collectives.all_gather_uneven(torch.ones(3, 2, device=cuda))
    out["gather"], out["gather_counts"] = rows, counts
    out["devices"]["gather"] = rows.device.type
    parts, counts = ls.collectives.all_gather_uneven_dict({"x": torch.ones(2, device=cuda),
                                                           "i": torch.arange(2, device=cuda)})
    out["gather_dict"] = parts
    out["gather_to_0"] = ls.collectives.gather_uneven(torch.zeros(1, 5, device=cuda), dst=0)
    out["objects"] = ls.collectives.gather_objects({"t": torch.full((2,), 7.0, device=cuda)}, safe=True)
    out["broadcast"] = ls.collectives.broadcast_object(("x", 1), src=0, safe=True)
    out["seed"] = ls.collectives.broadcast_seed(1234)
    ls.collectives.check_same_layout(t, caller="gpu tier")
    # the transport the functions use on more ranks, on NCCL: metadata, padded bytes, gather to one rank
    record = [0] * C_._META_LEN
    record[C_._I_PAYLOAD] = 5
    out["records"] = C_._exchange(record, None, cuda)
    payload = torch.arange(10, dtype=torch.uint8, device=cuda)
    out["padded"] = C_._padded_exchange([payload[:4], payload[4:7]], [7], None, cuda)
    out["padded_dst"] = C_._padded_exchange([payload], [10], None, cuda, dst=0)
    out["texts"] = C_._all_gather_texts("gpu ✓", None, cuda)
    raw = P_.to_bytes({"t": torch.arange(3.0, device=cuda)})
    back = P_.from_bytes(raw, safe=True)
    out["devices"]["unpickled"] = back["t"].device.type
    out["unpickled"] = back
    # the guard around NCCL work (no sliced waits there: NCCL's wait(timeout) aborts the communicator)
    with CollectiveGuard(timeout=20) as guard:
        x = torch.ones(4, device=cuda)
        dist.all_reduce(x)
        gathered = torch.empty(4, device=cuda)
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(gathered, x)  # torch 2.13 renamed it
        dist.broadcast(x, src=0)
        dist.barrier(device_ids=[cuda.index])
        # NCCL work that completes long after the call: the GPU spins ~1 s first. A guard that waited
        # in 0.1 s slices (Work.wait(timeout)) would abort the communicator here.
        torch.cuda._sleep(2_000_000_000)
        slow = torch.ones(4, device=cuda)
        start = time.monotonic()
        dist.all_reduce(slow)
        out["queued_s"] = time.monotonic() - start
        torch.cuda.synchronize()
        out["slow"] = slow
        out["guarded"] = gathered
        # the watched default group on NCCL: torch's backend object and name unchanged, DDP's bucket seen from
        # the autograd thread that runs CUDA backward (no Python frame of the program there)
        world = dist.group.WORLD
        out["watched"] = [type(world).__name__, str(dist.get_backend()),
                          type(world._get_backend(cuda)).__name__]
        model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2).to(cuda), device_ids=[cuda.index])
        guard.watch_module(model)
        model(torch.randn(8, 4, device=cuda)).sum().backward()
        torch.cuda.synchronize()
        out["history"] = list(guard.history)
        out["guard_failure"] = repr(guard.failure)
    out["restored"] = dist.all_reduce.__module__
    out["world_after"] = type(dist.group.WORLD).__name__
    work = C_._device_barrier(async_op=True)
    work.wait(timedelta(seconds=30))
    C_._device_barrier()
    # torch's CUDA SyncBatchNorm kernels (what lightning_sync.SyncBatchNorm runs on NCCL), against
    # BatchNorm on the same batch
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(16, C, 4, generator=g) * 2 + 1).to(cuda).requires_grad_(True)
    weight = torch.tensor([1.5, -0.5, 2.0], device=cuda, requires_grad=True)
    bias = torch.tensor([0.1, 0.2, -0.3], device=cuda, requires_grad=True)
    rm, rv = torch.zeros(C, device=cuda), torch.ones(C, device=cuda)
    y = TorchSyncBatchNormFunction.apply(x, weight, bias, rm, rv, 1e-5, 0.1, dist.group.WORLD, 1)
    dy = torch.randn(16, C, 4, generator=g).to(cuda)
    (y * dy).sum().backward()
    out["kernel"] = {"y": y, "dx": x.grad, "dw": weight.grad, "db": bias.grad, "rm": rm, "rv": rv}
    xr = x.detach().clone().requires_grad_(True)
    wr, br = weight.detach().clone().requires_grad_(True), bias.detach().clone().requires_grad_(True)
    rmr, rvr = torch.zeros(C, device=cuda), torch.ones(C, device=cuda)
    yr = nn.functional.batch_norm(xr, rmr, rvr, wr, br, True, 0.1, 1e-5)
    (yr * dy).sum().backward()
    out["reference"] = {"y": yr, "dx": xr.grad, "dw": wr.grad, "db": br.grad, "rm": rmr, "rv": rvr}
    return _cpu(out)


@pytest.mark.timeout(180)
def test_nccl_world_of_one_collectives_transport_guard_and_kernels() -> None:
    (res,) = run_ranks(_nccl_world_of_one, world_size=1, backend="nccl", timeout=150)
    assert res["all_reduce"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert res["gather_counts"] == [3] and res["gather"].shape == (3, 2) and res["devices"]["gather"] == "cuda"
    assert res["gather_dict"]["i"].tolist() == [0, 1]
    rows, counts = res["gather_to_0"]
    assert rows.shape == (1, 5) and counts == [1]
    assert res["objects"][0]["t"].tolist() == [7.0, 7.0] and res["broadcast"] == ("x", 1) and res["seed"] == 1234
    assert len(res["records"]) == 1 and res["records"][0][4] == 5
    assert res["padded"].tolist() == [list(range(7))] and res["padded_dst"].tolist() == [list(range(10))]
    assert res["texts"] == ["gpu ✓"]
    assert res["unpickled"]["t"].tolist() == [0.0, 1.0, 2.0] and res["devices"]["unpickled"] == "cuda"
    assert res["guarded"].tolist() == [1.0] * 4 and res["guard_failure"] == "None"
    assert res["slow"].tolist() == [1.0] * 4 and res["queued_s"] < 0.5, res["queued_s"]  # queued, not waited for
    assert res["restored"].startswith("torch.distributed"), "the guard left torch.distributed wrapped"
    assert res["watched"] == ["WatchedGroup", "nccl", "ProcessGroupNCCL"], res["watched"]
    assert any("DistributedDataParallel backward: DDP gradient all-reduce float32[" in h for h in res["history"]), \
        res["history"]
    assert res["world_after"] == "ProcessGroup", "the guard left the default group watched"
    for key, want in res["reference"].items():
        torch.testing.assert_close(res["kernel"][key], want, rtol=TOL, atol=TOL, msg=lambda m, k=key: f"{k}: {m}")


# ------------------------------------------------------------------ two ranks on one GPU over gloo


SIZES = (5, 3)  # rows per rank: uneven


def _global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(sum(SIZES), C, 4, generator=g) * torch.tensor([1.0, 0.5, 2.0]).view(1, C, 1) + 3.0
    return x, torch.randn(sum(SIZES), C, 4, generator=g)


def _bn_steps(layer: nn.Module, lo: int, hi: int, device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {"y": [], "dx": [], "dw": [], "db": []}
    for step in range(STEPS):
        x_all, dy_all = _global_batch(step)
        x = x_all[lo:hi].to(device).requires_grad_(True)
        layer.zero_grad()
        y = layer(x)
        (y * dy_all[lo:hi].to(device)).sum().backward()
        out["y"].append(y.detach())
        out["dx"].append(x.grad)
        out["dw"].append(layer.weight.grad.clone())
        out["db"].append(layer.bias.grad.clone())
    out["buffers"] = {k: v.clone() for k, v in layer.named_buffers()}
    return _cpu(out)


def _gloo_cuda(rank: int, world: int) -> dict[str, Any]:
    import lightning_sync as ls

    cuda = torch.device("cuda", 0)
    torch.cuda.set_device(cuda)
    out: dict[str, Any] = {}
    rows, counts = ls.collectives.all_gather_uneven(torch.full((SIZES[rank], 2), float(rank), device=cuda))
    out["gather"], out["counts"], out["device"] = rows, counts, rows.device.type
    big = torch.full((rank + 1,), 2**53 + rank, dtype=torch.int64, device=cuda)
    out["gather_big"] = ls.collectives.all_gather_uneven(big)[0]
    rows0, _ = ls.collectives.gather_uneven(torch.full((rank, 3), 1.0 + rank, device=cuda), dst=1)
    out["gather_to_1"] = rows0
    out["mean"] = ls.collectives.all_reduce(torch.tensor([1.0 + rank], device=cuda), op="mean")
    out["objects"] = ls.collectives.gather_objects({"t": torch.full((rank + 1,), float(rank), device=cuda)}, safe=True)
    out["seed"] = ls.collectives.broadcast_seed(77 + rank)
    layer = ls.SyncBatchNorm(C).to(cuda)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([1.5, -0.5, 2.0]))
        layer.bias.copy_(torch.tensor([0.1, 0.2, -0.3]))
    lo = sum(SIZES[:rank])
    out["bn"] = _bn_steps(layer, lo, lo + SIZES[rank], cuda)
    return _cpu(out)


@pytest.mark.timeout(180)
def test_two_ranks_on_one_gpu_over_gloo_with_cuda_tensors() -> None:
    results = run_ranks(_gloo_cuda, world_size=2, timeout=150)
    for res in results:
        assert res["counts"] == list(SIZES) and res["device"] == "cuda"
        assert res["gather"].tolist() == [[0.0, 0.0]] * 5 + [[1.0, 1.0]] * 3
        assert res["gather_big"].tolist() == [2**53, 2**53 + 1, 2**53 + 1]
        assert res["mean"].tolist() == [1.5]
        assert [o["t"].tolist() for o in res["objects"]] == [[0.0], [1.0, 1.0]]
        assert res["seed"] == 77
    assert results[0]["gather_to_1"] is None and results[1]["gather_to_1"].tolist() == [[2.0] * 3]
    # the portable SyncBatchNorm on CUDA tensors == native BatchNorm (CUDA) on the concatenated batch
    ref_layer = nn.BatchNorm1d(C).cuda()
    with torch.no_grad():
        ref_layer.weight.copy_(torch.tensor([1.5, -0.5, 2.0]))
        ref_layer.bias.copy_(torch.tensor([0.1, 0.2, -0.3]))
    ref = _bn_steps(ref_layer, 0, sum(SIZES), torch.device("cuda"))
    per_rank = [r["bn"] for r in results]
    for step in range(STEPS):
        for key in ("y", "dx"):
            torch.testing.assert_close(torch.cat([r[key][step] for r in per_rank]), ref[key][step], rtol=TOL, atol=TOL)
        for key in ("dw", "db"):  # per-rank parameter gradients sum to the full batch's
            torch.testing.assert_close(sum(r[key][step] for r in per_rank), ref[key][step], rtol=TOL, atol=TOL)
    for name, value in ref["buffers"].items():
        for r in per_rank:
            torch.testing.assert_close(r["buffers"][name], value, rtol=TOL, atol=TOL)


def test_invariant_dropout_masks_on_cuda_are_the_cpu_ones() -> None:
    """World-size-invariant dropout hashes each element's place in the global batch with int64 arithmetic: the same
    masks on CUDA as on CPU (wrapping multiplication, masked shifts), for any slice, in float32 and bfloat16; under
    activation checkpointing the recomputation draws the forward's masks."""
    from lightning_sync.invariance import DropoutStep, _keep_mask, dropout_step, make_dropout_invariant

    for key in (0, -(1 << 63), 123456789123456789):
        cpu = _keep_mask(key, 1 << 40, (64, 333), 0.3)
        assert torch.equal(_keep_mask(key, 1 << 40, (64, 333), 0.3, device="cuda").cpu(), cpu)
    layer = nn.Dropout(0.25).cuda()
    make_dropout_invariant(layer)
    x = torch.ones(12, 7, device="cuda", dtype=torch.bfloat16)
    with dropout_step(DropoutStep(root=3, epoch=1, step=2, rows=12, offset=0, local=12)):
        whole = layer(x)
    with dropout_step(DropoutStep(root=3, epoch=1, step=2, rows=12, offset=5, local=7)):
        part = layer(x[5:])
    assert whole.dtype == torch.bfloat16 and torch.equal(part, whole[5:])
    layer.cpu()
    with dropout_step(DropoutStep(root=3, epoch=1, step=2, rows=12, offset=0, local=12)):
        assert torch.equal(layer(x.cpu()), whole.cpu())
    # activation checkpointing: CUDA's backward runs on autograd's device thread, where the recomputation must still
    # see the step (lightning_sync.invariance.checkpoint_context sets it there)
    from torch.utils.checkpoint import checkpoint

    from lightning_sync.invariance import checkpoint_context

    block = nn.Sequential(nn.Linear(6, 32), nn.Dropout(0.5), nn.ReLU(), nn.Linear(32, 1)).cuda()
    make_dropout_invariant(block)
    x = torch.randn(8, 6, device="cuda")
    grads = []
    for run in (block, lambda t: checkpoint(block, t, use_reentrant=False, context_fn=checkpoint_context)):
        block.zero_grad()
        with dropout_step(DropoutStep(root=1, epoch=0, step=5, rows=8, offset=0, local=8)):
            run(x).square().sum().backward()
        grads.append([p.grad.clone() for p in block.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    with dropout_step(DropoutStep(root=1, epoch=0, step=5, rows=8, offset=0, local=8)), \
            pytest.raises(RuntimeError, match="ran again during backward"):
        checkpoint(block, x, use_reentrant=False).square().sum().backward()


# ------------------------------------------------------------------ the Trainer on one GPU (NCCL)


def _script(name: str, out: Path, *args: str, timeout: int = 300) -> None:
    launch_script(SCRIPTS / name, out, *args, timeout=timeout)


@pytest.mark.timeout(400)
def test_native_syncbatchnorm_and_bf16_through_the_trainer(tmp_path: Path) -> None:
    _script("gpu_trainer.py", tmp_path, "--case", "syncbn")
    report = json.loads((tmp_path / "syncbn.json").read_text())
    assert report["syncbn"]["backend"] == "nccl" and report["syncbn"]["device"].startswith("cuda")
    assert set(report["syncbn"]["bn_classes"]) == {"lightning_sync.batchnorm.SyncBatchNorm"}
    assert set(report["plain"]["bn_classes"]) == {"torch.nn.modules.batchnorm.BatchNorm1d"}
    assert report["flight_recorder"]["buffer"] == "2000" and report["flight_recorder"]["entries"] > 0
    ours, plain = torch.load(tmp_path / "syncbn.pt"), torch.load(tmp_path / "plain.pt")
    assert ours.keys() == plain.keys()
    for key in ours:  # one GPU: the synchronised layer must train exactly like BatchNorm
        torch.testing.assert_close(ours[key], plain[key], rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")

    _script("gpu_trainer.py", tmp_path, "--case", "bf16")
    report = json.loads((tmp_path / "bf16.json").read_text())
    assert report["precision"] == "bf16-mixed" and report["loss_dtype"] == "torch.bfloat16"
    # the sync_dist epoch value is the sample-weighted mean over the whole set (ragged last batch)
    assert report["val_loss"] == pytest.approx(report["val_loss_by_hand"], rel=1e-5)
    assert report["train_loss_last"] < report["train_loss_first"]


@pytest.mark.timeout(600)
def test_mid_epoch_resume_with_cuda_rng_states_is_bit_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 50 samples, batch 4, one rank: 13 steps an epoch; stopped at step 10 (mid-epoch); dropout draws
    # from the CUDA generator, whose state must come back with the checkpoint
    plan = "full:3@g,stop:3:10:5@gstop,resume:3:gstop@gresume"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic workspace
    _script("fit_resume.py", tmp_path, "--accelerator", "gpu", "--devices", "1", "--plan", plan, timeout=500)
    full, stop, resumed = (json.loads((tmp_path / tag / "rank0.json").read_text())["steps"]
                           for tag in ("g", "gstop", "gresume"))
    assert stop == full[:10] and resumed == full[10:]
    a, b = torch.load(tmp_path / "g" / "rank0.pt"), torch.load(tmp_path / "gresume" / "rank0.pt")
    assert all(torch.equal(a[k], b[k]) for k in a), "the resumed run ended with other weights"
    ckpt = torch.load(tmp_path / "gstop" / "last.ckpt", weights_only=False)
    states = ckpt["lightning_sync"]["rng_states"]
    assert len(states) == 1 and len(states[0]["cuda"]) == torch.cuda.device_count(), "no CUDA RNG state stored"


@pytest.mark.timeout(600)
def test_validation_gather_and_prediction_writer_with_cuda_outputs(tmp_path: Path) -> None:
    from tests.test_gather import check_gathered, exact_metrics
    from tests.test_predict import check_main

    gpu = ["--accelerator", "gpu", "--devices", "1"]
    _script("eval_gather.py", tmp_path / "gather", *gpu, "--phase", "small")
    (rep,) = [json.loads((tmp_path / "gather" / "small.rank0.json").read_text())]
    w = rep["validate"]["weights"]
    check_gathered(rep["validate"]["gathered"]["0"], list(range(1001)), w, 1001)
    check_gathered(rep["validate"]["gathered"]["1"], list(range(7)), w, 7)
    check_gathered(rep["test"]["gathered"]["0"], [0, 1, 2], w, 3)
    acc, auroc = exact_metrics(w, 1001)
    assert rep["validate"]["callback_metrics"]["val_auroc/dataloader_idx_0"] == pytest.approx(auroc, abs=1e-5)
    assert rep["validate"]["callback_metrics"]["val_acc/dataloader_idx_0"] == pytest.approx(acc, abs=1e-6)

    big = 200_003
    _script("predict_parquet.py", tmp_path / "predict", *gpu, "--big", str(big), "--errors", "exists", timeout=500)
    check_main(tmp_path / "predict", 1, big, padded=False, memory=False)


@pytest.mark.timeout(400)
def test_lsync_train_gpu_ddp_on_one_gpu(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = subprocess.run(["timeout", "-k", "5", "360", sys.executable, "-m", "lightning_sync.train", "trainer=gpu_ddp",
                           "trainer.devices=1", "seed=1234", f"hydra.run.dir={run}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["val_size"] == 359
    assert summary["val_acc"] >= 0.95, summary  # 0.9916 on 2 CPU ranks (README)


@pytest.mark.timeout(600)
def test_sync_model_parallel_strategy_fsdp2_on_one_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_fsdp2 import _one_process_mse

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    for phase in ("eval", "full", "stop", "resume"):
        _script("fit_fsdp2.py", tmp_path, "--strategy", "model_parallel_sync", "--phase", phase,
                "--accelerator", "gpu", "--devices", "1", "--lr", "0.01")
    (ev,) = [json.loads((tmp_path / "eval" / "rank0.json").read_text())]
    reference = _one_process_mse(tmp_path / "eval" / "full.pt")  # on the CPU, from the same weights
    assert ev["seed"] == 1234 and ev["metrics"]["val_mse"] == pytest.approx(reference, rel=1e-4)
    full, stop, resumed = (json.loads((tmp_path / p / "rank0.json").read_text())["steps"]
                           for p in ("full", "stop", "resume"))
    assert stop == full[:10] and resumed == full[10:]
    a, b = torch.load(tmp_path / "full" / "full.pt"), torch.load(tmp_path / "resume" / "full.pt")
    assert all(bool(torch.isfinite(v).all()) for v in a.values()), "the run diverged: the comparison would be empty"
    assert all(torch.equal(a[k], b[k]) for k in a), "FSDP2 on one GPU: the resumed run ended with other weights"
