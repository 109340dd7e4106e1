"""FSDP2 (``fully_shard``) state through the Checkpointer on CPU ranks: an async save whose parameters and
Adam state (DTensor shards) are copied in the background while the next step runs, then a load into a
freshly built sharded model. Writes ``--out/rank-R.json`` (what was deferred, whether the load matched)
and, on rank 0, ``--out/saved.pt``: the full parameters at the saved step, for a 1-rank load to compare."""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

from azulite import train

WIDTH, LAYERS = 64, 4


def plain_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = plain_model()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in sd.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    ctx = train.init(seed=0)
    model, opt = build()
    gen = torch.Generator().manual_seed(ctx.rank)

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(8, WIDTH, generator=gen)).square().mean().backward()
        opt.step()

    step()
    step()
    progress = train.Progress(step=2)
    ck = train.Checkpointer(train.CheckpointConfig(uri=args.ckpt), ctx,
                            {"model": train.ModelState(model, opt), "progress": progress})
    saved = full_params(model)
    # white box: keep the Checkpointer's save thread busy a moment, so the step below certainly finds the
    # background copy unfinished (a model this small is otherwise copied before the step starts)
    ck._thread = ThreadPoolExecutor(max_workers=1)
    ck._thread.submit(time.sleep, 0.5)
    ck.save(2, sync=False)
    deferred = sorted(ck._stager.deferred)  # white box: what the background copy took
    step()  # waits for the copy in the optimizer's step pre-hook
    ck.wait()
    moved = not all(torch.equal(saved[k], v) for k, v in full_params(model).items())
    ck.close()

    fresh, fresh_opt = build()
    reader = train.Checkpointer(train.CheckpointConfig(uri=args.ckpt), ctx,
                                {"model": train.ModelState(fresh, fresh_opt), "progress": train.Progress()})
    loaded_step = reader.load_latest()
    loaded = full_params(fresh)
    equal = all(torch.equal(saved[k], loaded[k]) for k in saved)
    reader.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if ctx.is_main:
        torch.save(saved, out / "saved.pt")
    (out / f"rank-{ctx.rank}.json").write_text(json.dumps({"deferred": deferred, "moved": moved,
                                                           "loaded_step": loaded_step, "equal": equal}))
    train.shutdown(ctx)


if __name__ == "__main__":
    main()
