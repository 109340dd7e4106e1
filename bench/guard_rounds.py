"""The guard's cost (issue 11: guarded/off >= 0.95x at c=32), measured so that one run can tell the goal
from a miss: guarded and off interleaved over several rounds, each round on freshly started servers
(a server's own state — a warm cache, a grown heap, a batcher's settled rhythm — stays inside its round),
the order within a round flipping every round, and the median of the per-round ratios reported beside
every round's figures. Used by bench/serving.py (its guard part) and bench/guard_overhead.py.

What a round measures, per protocol, on each side: perf_analyzer's throughput and p99 at concurrency c,
and the server's CPU per request — user+system CPU seconds of the server process (all its threads) over
the inference requests it counted (success and failure: a refusal costs CPU too) — with the event-loop
thread's apart and the audit writer process's apart (serve/audit_writer.py runs beside the server on
another core), and requests per model execution (the batch size dynamic batching reached moves CPU per
request by itself).

Same work on both sides: over HTTP both servers are sent the very same requests, the key header included
(ignored when off), and both run with gRPC closed; over gRPC perf_analyzer sends no metadata (its ``-H``
is HTTP-only), so the guarded gRPC server runs the limits and the audit log with no key (``grpc_auth``:
false in the figures). The guard's figures are set high (a rate of 1e9/s, a quota of 1e12/day): checked
on every request, never refusing; a round in which the guarded server refused anything, or either side
failed to measure, is kept in ``rounds`` with its reason and left out of the medians, and ``rounds_used``
says how many were used.
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import time
import urllib.request
from pathlib import Path

from serving import MODEL, free_port, perf, start_server, stop

TICK = os.sysconf("SC_CLK_TCK")
#: the guard's own settings on the guarded side (rates high: checked on every request, never refusing)
RATE, QUOTA = 1e9, 10**12


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def main_thread_cpu_s(pid: int) -> float:
    """User + system CPU seconds of the process's main thread alone: the event loop, where the guard's
    check and the audit's record run."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def children_cpu_s(pid: int) -> float:
    """User + system CPU seconds of the process's live children: the audit log's writer process."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[1]) == pid:
            total += (int(fields[11]) + int(fields[12])) / TICK
    return total


def counted(metrics_port: int) -> dict[str, int]:
    """The server's counts for the model: requests (success, failure), model executions, and the
    guard's refusals (``azulite_requests_rejected_total``, any model)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).read().decode()

    def total(name: str, model: bool = True) -> int:
        label = rf'\{{[^}}]*model="{MODEL}"[^}}]*\}}' if model else r"(?:\{[^}]*\})?"
        return sum(int(float(m.group(1))) for m in re.finditer(rf"^{name}{label} ([0-9.e+]+)$", text, re.M))

    return {"success": total("nv_inference_request_success"), "failure": total("nv_inference_request_failure"),
            "executions": total("nv_inference_exec_count"), "rejected": total("azulite_requests_rejected_total", False),
            "audit_lost": total("azulite_audit_write_errors_total", False) + total("azulite_audit_dropped_total", False)}


def wait_metrics(metrics_port: int, proc, timeout_s: float = 60.0) -> None:
    """The metrics endpoint answering: the server starts it after the HTTP endpoint that answered ready."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            counted(metrics_port)
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


#: the guard's parts (bench/guard_overhead.py --modes): "all" is the guard the goal is about
PARTS = {"all": ("auth", "limit", "audit"), "auth": ("auth",), "limit": ("limit",), "audit": ("audit",)}


def server_args(side: str, protocol: str, work: Path, key_store: Path, parts=PARTS["all"]) -> list[str]:
    """What one side's ``azulite serve`` adds to the common command line; ``parts``: the guard's parts on
    the guarded side ("auth": the key, with its own rate and quota; "limit": the model's rate limit;
    "audit": the audit log); "auth" is HTTP-only (perf_analyzer sends no gRPC metadata)."""
    args = ["--allow-grpc", "false"] if protocol == "http" else []
    if side == "guarded":
        if "limit" in parts:
            args += ["--model-rate-limit", f"{MODEL}={RATE:g}"]
        if "audit" in parts:
            args += ["--audit-log", str(work / f"audit-{protocol}.jsonl"), "--audit-log-max-bytes", str(16 * 1024 * 1024)]
        if "auth" in parts and protocol == "http":
            args += ["--auth", "--key-store", str(key_store)]
    return args


def measure_side(pa: Path, proc, protocol: str, port: int, metrics_port: int, concurrency: int, data: Path,
                 measure_ms: int, work: Path, headers: tuple[str, ...]) -> dict:
    pid = proc.pid
    t0, c0, w0, n0 = main_thread_cpu_s(pid), cpu_s(pid), children_cpu_s(pid), counted(metrics_port)
    r = perf(pa, protocol, port, concurrency, data, measure_ms, work, headers)
    t1, c1, w1, n1 = main_thread_cpu_s(pid), cpu_s(pid), children_cpu_s(pid), counted(metrics_port)
    requests = (n1["success"] + n1["failure"]) - (n0["success"] + n0["failure"])
    executions = n1["executions"] - n0["executions"]
    r["load_avg_1m"] = round(os.getloadavg()[0], 2)
    if "error" in r:
        return r
    if requests <= 0 or executions <= 0:
        return {**r, "error": "the server counted no requests"}
    r["failed"] = n1["failure"] - n0["failure"]
    r["rejected"] = n1["rejected"] - n0["rejected"]
    r["audit_lines_lost"] = n1["audit_lost"] - n0["audit_lost"]
    r["cpu_us_per_request"] = round((c1 - c0) / requests * 1e6, 1)
    r["main_thread_cpu_us_per_request"] = round((t1 - t0) / requests * 1e6, 1)
    r["writer_cpu_us_per_request"] = round((w1 - w0) / requests * 1e6, 1)
    r["requests_per_execution"] = round(requests / executions, 2)
    return r


RATIOS = (("throughput", "infer_per_s"), ("p99", "p99_ms"), ("cpu_per_request", "cpu_us_per_request"),
          ("main_thread_cpu_per_request", "main_thread_cpu_us_per_request"))


def round_ratio(off: dict, on: dict) -> dict:
    out = {name: round(on[f] / off[f], 3) for name, f in RATIOS}
    off_tree = off["cpu_us_per_request"] + off["writer_cpu_us_per_request"]
    out["cpu_per_request_with_writer"] = round((on["cpu_us_per_request"] + on["writer_cpu_us_per_request"])
                                               / off_tree, 3)
    return out


def left_out(row: dict) -> str | None:
    """Why a round cannot stand in the medians (None: it can): a side that failed to start or measure,
    or not the same work on both sides (failed requests, the guard refusing, audit lines lost)."""
    off, on = row.get("off", {}), row.get("guarded", {})
    reason = row.get("error") or off.get("error") or on.get("error")
    if not reason and not (off and on):
        reason = "a side was not measured"
    if not reason and (on["failed"] or on["rejected"] or off["failed"] or on["audit_lines_lost"]):
        reason = (f"requests failed (off {off['failed']}, guarded {on['failed']}), refused by the guard "
                  f"({on['rejected']}) or audit lines lost ({on['audit_lines_lost']}): not the same work "
                  f"on both sides")
    return reason


def summarize(per_round: list[dict]) -> dict:
    """Every round as measured, and over the rounds used (those with a ``ratio``): the medians of the
    per-round ratios, each side's medians, the throughput ratio's range and the goals (throughput >= 0.95x
    off, p99 <= 1/0.95x, and server CPU per request <= 1/0.95x: the throughput a CPU-bound server keeps)."""
    used = [r for r in per_round if "ratio" in r]
    summary: dict = {"rounds": per_round, "rounds_used": len(used)}
    if not used:
        return summary
    summary["median_ratio"] = {name: statistics.median(r["ratio"][name] for r in used) for name in used[0]["ratio"]}
    for side in ("off", "guarded"):
        summary[f"median_{side}"] = {f: statistics.median(r[side][f] for r in used) for f in SIDE_FIGURES}
    med = summary["median_ratio"]
    summary["goal_met"] = {"throughput": med["throughput"] >= 0.95, "p99": med["p99"] <= 1 / 0.95,
                           "cpu_per_request": med["cpu_per_request"] <= 1 / 0.95}
    summary["throughput_ratio_range"] = [min(r["ratio"]["throughput"] for r in used),
                                         max(r["ratio"]["throughput"] for r in used)]
    return summary


SIDE_FIGURES = ("infer_per_s", "p99_ms", "cpu_us_per_request", "main_thread_cpu_us_per_request",
                "writer_cpu_us_per_request", "requests_per_execution")


def measure(pa: Path, azulite_serve: list[str], token: str, key_store: Path, data: Path, work: Path, *,
            rounds: int, concurrency: int, measure_ms: int, protocols=("http", "grpc"), log=print,
            parts: tuple[str, ...] = PARTS["all"]) -> dict:
    """``rounds`` rounds; in each, per protocol, a fresh off and a fresh guarded server, measured one after
    the other (off first in even rounds, guarded first in odd ones), then stopped. ``azulite_serve``: the
    command line up to the repository; ``parts``: the guard's parts on the guarded side (server_args).
    Returns the figures: every round, medians, ratios, goals."""
    header = (f"Authorization:Bearer {token}",)
    result: dict = {"concurrency": concurrency, "rounds_asked": rounds, "grpc_auth": False, "parts": list(parts),
                    "guard": f"HTTP: --auth (key with rps {RATE:g} and quota {QUOTA}/day) + --model-rate-limit "
                             f"{MODEL}={RATE:g} + --audit-log; gRPC: the same without the key"}
    for protocol in protocols:
        per_round = []
        for round_no in range(rounds):
            sides = ("off", "guarded") if round_no % 2 == 0 else ("guarded", "off")
            servers: dict[str, tuple] = {}
            row: dict = {"round": round_no, "order": list(sides)}
            try:
                for side in sides:
                    h, g, m = free_port(), free_port(), free_port()
                    cmd = azulite_serve + ["--http-port", str(h), "--grpc-port", str(g), "--metrics-port", str(m),
                                           *server_args(side, protocol, work, key_store, parts)]
                    port = h if protocol == "http" else g
                    servers[side] = (start_server(f"{side}-{protocol}", cmd, h, work), port, m)
                    wait_metrics(m, servers[side][0])
                for side in sides:
                    proc, port, m = servers[side]
                    r = measure_side(pa, proc, protocol, port, m, concurrency, data, measure_ms, work,
                                     header if protocol == "http" else ())
                    row[side] = r
            except Exception as exc:  # noqa: BLE001 - a server that failed to start: said in the round
                row["error"] = f"{type(exc).__name__}: {exc}"
            finally:
                for proc, *_ in servers.values():
                    stop(proc)
            reason = left_out(row)
            if reason:
                row["left_out"] = reason
                log(f"  {protocol} round {round_no}: left out: {reason}")
            else:
                off, on = row["off"], row["guarded"]
                row["ratio"] = round_ratio(off, on)
                log(f"  {protocol} round {round_no} ({'/'.join(sides)}): off {off['infer_per_s']:.1f}/s "
                    f"p99 {off['p99_ms']:.3f} ms {off['cpu_us_per_request']:.1f} us | guarded "
                    f"{on['infer_per_s']:.1f}/s p99 {on['p99_ms']:.3f} ms {on['cpu_us_per_request']:.1f} us | "
                    f"x{row['ratio']['throughput']:.3f} thr, x{row['ratio']['p99']:.3f} p99, "
                    f"x{row['ratio']['cpu_per_request']:.3f} CPU/req | load {on['load_avg_1m']}")
            per_round.append(row)
        summary = summarize(per_round)
        result[protocol] = summary
    return result


def azulite_serve(repo: Path) -> list[str]:
    return [str(Path(sys.executable).parent / "azulite"), "serve", str(repo), "--http-address", "127.0.0.1",
            "--grpc-address", "127.0.0.1", "--metrics-address", "127.0.0.1"]
