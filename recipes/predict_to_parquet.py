"""Predictions under DDP to one Parquet file, in dataset order, every sample once (streamed, O(batch) memory).

    python recipes/predict_to_parquet.py                                  # 2 CPU processes (gloo)
    python recipes/predict_to_parquet.py --accelerator gpu --devices 4    # 4 GPUs (NCCL)

Add --resume to continue a run that was killed: the batches it finished are not predicted again.
Under DDP every rank predicts its own share; collecting them yourself means per-rank files, a merge
that loads everything, and Lightning's padding duplicates. `ls.PredictionWriter` streams each
rank's rows (with their dataset indices) to part files and merges them into one file whose
`index` column is 0..N-1 in order, once each; `preds.manifest.json` beside it records the counts.
Needs pyarrow: pip install "lightning_sync[parquet]".
"""

import argparse

import lightning as L
import pyarrow.parquet as pq
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_sync as ls


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 3)

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> dict:
        (x,) = batch
        probs = self.net(x).softmax(dim=1)
        # one row per sample: a vector (a fixed-size list column), a number, a string
        return {"probs": probs, "pred": probs.argmax(dim=1), "label": [f"class_{int(c)}" for c in probs.argmax(dim=1)]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--size", type=int, default=1001, help="data set size (odd: ranks get different counts)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--out", default="outputs/recipes/predict_to_parquet/preds.parquet")
    p.add_argument("--resume", action="store_true", help="skip the batches an interrupted run finished")
    args = p.parse_args()

    x = torch.randn(args.size, 8, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x), batch_size=args.batch_size)
    writer = ls.PredictionWriter(args.out, overwrite=not args.resume, resume=args.resume)
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, strategy="ddp_sync", callbacks=[writer],
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    torch.manual_seed(0)  # the same weights in every process (and in the single-process check below)
    model = Classifier()
    trainer.predict(model, loader, return_predictions=False)  # False: Lightning keeps nothing in memory

    counts = {r["rank"]: r["rows_kept"] for r in writer.manifest["ranks"]}  # every rank holds the manifest
    print(f"rank {trainer.global_rank} sees {writer.manifest['rows']} rows written, per rank {counts}", flush=True)
    if trainer.global_rank == 0:  # the check: read the file back, compare with one process on the whole set
        table = pq.read_table(args.out)
        index = table.column("index").to_numpy()
        print(f"columns {table.column_names}; index == range(N): {index.tolist() == list(range(args.size))}")
        with torch.no_grad():
            reference = model.cpu().net(x).softmax(dim=1)
        probs = torch.tensor(table.column("probs").to_pylist())
        print(f"max |probs - single-process probs| {float((probs - reference).abs().max())!r}", flush=True)


if __name__ == "__main__":
    main()
