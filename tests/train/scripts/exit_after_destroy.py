"""Two ranks: start an async save, then destroy the process group and end, without ``wait()`` or
``close()`` (as torch's tutorials and examples/ddp end): the save must still be committed (its commit's
gather ran on the destroyed group: "rank 1 wrote no hashes", and the script exited 0)."""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from azulite import train


def main() -> None:
    ctx = train.init(seed=0)
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    ck = train.Checkpointer(train.CheckpointConfig(uri=sys.argv[1]), ctx, {"model": train.ModelState(model, opt)})
    # the commit still under way when the group is destroyed, whatever the machine's speed (the sleep only
    # holds the commit's thread back; the script's own thread goes straight on to destroy the group)
    ck.phase_hook = lambda phase, step: time.sleep(1.0) if phase == "shards_written" else None
    ck.save(1, sync=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
