"""Start an async save and end the script at once, without ``wait()`` or ``close()``: the save must still
be committed (the interpreter refuses new thread pools once it shuts down, and the commit uses one)."""

from __future__ import annotations

import sys

import torch

from azulite import train


def main() -> None:
    ctx = train.init({}, seed=0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    ck = train.Checkpointer(train.CheckpointConfig(uri=sys.argv[1]), ctx, {"model": train.ModelState(model, opt)})
    ck.save(1, sync=False)


if __name__ == "__main__":
    main()
