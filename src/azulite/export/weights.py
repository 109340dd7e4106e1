"""A sharded DCP checkpoint -> one module's full state dict, in this one process (no process group).

DCP reassembles every tensor from whatever shards the ranks wrote (DDP's de-duplicated copies, FSDP2's
DTensor shards, TorchRec's sharded embedding tables) into the plain tensors of the freshly built module:
the gather happens in the reader's planner, not by hand.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from azulite.errors import ExportError


def load_module_state(model: Any, checkpoint_dir: Path, state_key: str, *, where: str) -> int:
    """Fill ``model``'s parameters and buffers from the checkpoint; returns the number of tensors loaded.

    The Checkpointer saves ``{state_key: ModelState}`` whose state is ``{"model": ..., "optim": ...}``, so
    the module's tensors sit under ``<state_key>.model.``; a module saved directly under ``<state_key>.``
    works too. Every tensor of the module must be in the checkpoint and the other way round."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException, FileSystemReader

    reader = FileSystemReader(str(checkpoint_dir))
    meta = reader.read_metadata().state_dict_metadata
    saved = set(meta)
    for prefix in (f"{state_key}.model.", f"{state_key}."):
        if any(k.startswith(prefix) for k in saved):
            break
    else:
        tops = sorted({k.split(".", 1)[0] for k in saved})
        raise ExportError(f"the checkpoint has no state named {state_key!r} (its states: {tops})", where=where,
                          fix="set model_config.state_key to the Checkpointer state entry that holds the model")
    own = model.state_dict()
    theirs = {k[len(prefix):] for k in saved if k.startswith(prefix)}
    missing = sorted(set(own) - theirs)
    extra = sorted(theirs - set(own))
    if missing or extra:
        raise ExportError(
            f"the rebuilt model does not match the checkpoint's {state_key!r}: "
            + "; ".join(s for s in (f"not in the checkpoint: {missing[:5]}" if missing else "",
                                     f"not in the model: {extra[:5]}" if extra else "") if s),
            where=where, fix="model_config.factory and kwargs must build the very architecture that was trained")
    flat = {prefix + k: v for k, v in own.items()}
    wrong = [f"{k}: checkpoint {list(meta[prefix + k].size)}, model {list(v.shape)}" for k, v in own.items()
             if hasattr(meta[prefix + k], "size") and hasattr(v, "shape") and tuple(meta[prefix + k].size) != tuple(v.shape)]
    if wrong:
        raise ExportError(f"the rebuilt model's shapes differ from the checkpoint's {state_key!r}: {'; '.join(wrong[:4])}",
                          where=where, fix="model_config.kwargs must give the trained shapes")
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled ... load in a single process": intended
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(flat, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict) and failures:
            inner = next(iter(failures.values()))
            e = inner[0] if isinstance(inner, tuple) else inner
        raise ExportError(f"cannot load {state_key!r} from the checkpoint: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:400] if str(e) else ''}", where=where) from None
    # state_dict() tensors share storage with the module for plain modules; load them explicitly so a module
    # whose state_dict returns copies (some wrappers do) gets them too
    model.load_state_dict({k: flat[prefix + k] for k in own}, strict=True)
    return len(own)
