"""nccl-tests' semantics without torch: the collectives, their bus-bandwidth factors, the size sweep and
the table layout. The CLI and the job builder import this module; the per-rank program
(:mod:`azulite.bench.collectives`) adds the torch part."""

from __future__ import annotations

from dataclasses import dataclass

OPS = ("all_reduce", "all_gather", "reduce_scatter", "alltoall", "broadcast")
RESULT_FILE = "collectives.json"
_ELEM = 4  # float32, nccl-tests' default type


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw ratio for ``op`` on ``n`` ranks."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "alltoall"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {op!r}")


def size_sweep(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """nccl-tests' ``-b min -e max -f factor`` sizes: min, min*f, ... up to max."""
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= factor
    return out


def element_count(op: str, size: int, n: int) -> int:
    """float32 elements of the S-byte buffer, rounded down so the per-rank chunks are whole (as nccl-tests)."""
    count = size // _ELEM
    if op in ("all_gather", "reduce_scatter", "alltoall"):
        count -= count % n
    return count


@dataclass(frozen=True)
class Row:
    op: str
    size: int  # bytes, S
    count: int  # elements of S
    time_us: float
    algbw: float  # GB/s (1e9)
    busbw: float
    wrong: int
    redop: str
    root: int


# ---- rendering (used by the CLI on rank 0's JSON) ---------------------------------------------------
def table(rows: list[dict], *, world_size: int, backend: str, memcopy_gbps: float | None) -> str:
    """The result in nccl-tests' layout: one block per collective, out-of-place columns, the average bus
    bandwidth after each block."""
    lines = [f"# azulite bench collectives: {world_size} ranks, {backend}"]
    if memcopy_gbps is not None:
        lines.append(f"# memory-copy bandwidth (local limit): {memcopy_gbps:.2f} GB/s")
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op]
        lines += [
            "#",
            f"# Collective test: {op}",
            f"#{'size':>12} {'count':>13} {'type':>9} {'redop':>7} {'root':>7} {'time':>10} {'algbw':>8} {'busbw':>8} {'#wrong':>7}",
            f"#{'(B)':>12} {'(elements)':>13} {'':>9} {'':>7} {'':>7} {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8} {'':>7}",
        ]
        for r in mine:
            lines.append(f" {r['size']:>12} {r['count']:>13} {'float':>9} {r['redop']:>7} {r['root']:>7} "
                         f"{r['time_us']:>10.1f} {r['algbw']:>8.3f} {r['busbw']:>8.3f} {r['wrong']:>7}")
        avg = sum(r["busbw"] for r in mine) / len(mine)
        lines.append(f"# Out of bounds values : {sum(r['wrong'] for r in mine)} {'OK' if not any(r['wrong'] for r in mine) else 'FAILED'}")
        lines.append(f"# Avg bus bandwidth    : {avg:.3f}")
    return "\n".join(lines)
