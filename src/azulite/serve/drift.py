"""Output monitoring: per model, the distribution of each numeric output in a rolling window compared
with a reference window, as PSI (population stability index) and the two-sample KS statistic, exported
as Prometheus gauges (``azulite_output_psi``, ``azulite_output_ks``) that the serving alert rules watch
(``azulite.serve.alerts``).

A model opts in with a config parameter (Triton configs carry free-form parameters):

```
parameters { key: "azulite_drift_window" value: { string_value: "2000" } }
```

The reference is the first ``window`` values the model answers after it loads; the current window is
the last ``window`` values. The request path only copies a few values per output (at most
``per_request``, evenly spaced) into a preallocated ring; the statistics are computed at scrape time.
The KS statistic is written here (a sort and a searchsorted over two small arrays) rather than adding
scipy to the server for one function.

With ``ServerSettings.shared_state_dir`` the windows live in memory-mapped files every worker of the
server updates (serve/sharedstate.py): the figures are then those of all the workers' answers together.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from azulite.errors import ModelLoadError
from azulite.serve.proto import model_config_pb2 as mc

WINDOW_PARAM = "azulite_drift_window"
PSI_BINS = 10
_EPS = 1e-4


def window_of(config: mc.ModelConfig) -> int:
    """The model's drift window (0: not monitored); a bad value fails the load, naming the parameter."""
    if WINDOW_PARAM not in config.parameters:
        return 0
    text = config.parameters[WINDOW_PARAM].string_value.strip()
    if not text.isdigit() or not 10 <= int(text) <= 10_000_000:
        raise ModelLoadError(f"model '{config.name}': parameter '{WINDOW_PARAM}' must be a whole number of "
                             f"values between 10 and 10000000, got {text!r}", fix='e.g. string_value: "2000"')
    return int(text)


def psi(reference: np.ndarray, current: np.ndarray, bins: int = PSI_BINS) -> float:
    """PSI over the reference's quantile bins: sum((c - r) * ln(c / r)). 0: same; > 0.25: a large shift."""
    edges = np.unique(np.quantile(reference, np.linspace(0, 1, bins + 1)[1:-1]))
    r = np.bincount(np.searchsorted(edges, reference, side="right"), minlength=len(edges) + 1) / len(reference)
    c = np.bincount(np.searchsorted(edges, current, side="right"), minlength=len(edges) + 1) / len(current)
    r, c = np.maximum(r, _EPS), np.maximum(c, _EPS)
    return float(np.sum((c - r) * np.log(c / r)))


def ks(reference: np.ndarray, current: np.ndarray) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical CDFs."""
    a, b = np.sort(reference), np.sort(current)
    points = np.concatenate([a, b])
    cdf_a = np.searchsorted(a, points, side="right") / len(a)
    cdf_b = np.searchsorted(b, points, side="right") / len(b)
    return float(np.max(np.abs(cdf_a - cdf_b)))


class _Series:
    """One output's reference (filled once) and current ring. ``meta`` holds (filled, pos, count): in
    this process's arrays, or in a shared file's mapping (serve/sharedstate.py) that every worker of the
    server updates, so one code runs on both."""

    __slots__ = ("window", "reference", "ring", "meta")

    def __init__(self, window: int, reference=None, ring=None, meta=None) -> None:
        self.window = window
        self.reference = np.empty(window, dtype=np.float64) if reference is None else reference
        self.ring = np.empty(window, dtype=np.float64) if ring is None else ring
        self.meta = np.zeros(3, dtype=np.int64) if meta is None else meta

    @property
    def filled(self) -> int:
        return int(self.meta[0])

    def add(self, values: np.ndarray) -> None:
        meta, window = self.meta, self.window
        filled = int(meta[0])
        n = len(values)
        if filled < window:
            take = min(n, window - filled)
            self.reference[filled:filled + take] = values[:take]
            meta[0] = filled + take
            values = values[take:]
            n = len(values)
            if not n:
                return
        if n >= window:
            values, n = values[-window:], window
        pos = int(meta[1])
        end = pos + n
        if end <= window:
            self.ring[pos:end] = values
        else:
            first = window - pos
            self.ring[pos:] = values[:first]
            self.ring[:n - first] = values[first:]
        meta[1] = end % window
        meta[2] = min(window, int(meta[2]) + n)

    def current(self) -> np.ndarray:
        count = int(self.meta[2])
        return self.ring[:count].copy() if count < self.window else self.ring.copy()


@dataclass(frozen=True, slots=True)
class DriftFigures:
    output: str
    psi: float
    ks: float
    reference: int
    current: int


class OutputMonitor:
    """One model's monitor. ``observe`` on the request path; ``figures`` at scrape time. ``shared``: a
    SharedDriftStore when the server's workers share their windows (ServerSettings.shared_state_dir)."""

    def __init__(self, window: int, *, per_request: int = 16, shared=None) -> None:
        self.window = window
        self.per_request = per_request
        self.shared = shared
        self._series: dict[str, tuple[_Series, object]] = {}  # name -> (series, the lock guarding it)
        self._lock = threading.Lock()

    def _open(self, name: str) -> tuple[_Series, object]:
        if self.shared is None:
            got = (_Series(self.window), self._lock)
        else:
            f = self.shared.open(name, self.window)
            got = (_Series(self.window, f.reference, f.ring, f.meta), f.lock)
        self._series[name] = got
        return got

    def observe(self, outputs) -> None:
        """``outputs``: (name, array) pairs. Non-numeric outputs (BYTES, BOOL) are skipped."""
        for name, array in outputs:
            if array.dtype.kind not in "fiu" or not array.size:
                continue
            flat = array.reshape(-1)
            if flat.size > self.per_request:
                flat = flat[::flat.size // self.per_request][:self.per_request]
            got = self._series.get(name)
            if got is None:
                with self._lock:
                    got = self._series.get(name) or self._open(name)
            with got[1]:
                got[0].add(flat.astype(np.float64, copy=False))

    def figures(self) -> list[DriftFigures]:
        with self._lock:
            if self.shared is not None:  # outputs other workers answered and this one not yet
                for name in self.shared.outputs():
                    if name not in self._series:
                        self._open(name)
            series = sorted(self._series.items())
        out = []
        snapshot = []
        for name, (s, lock) in series:
            with lock:
                filled = s.filled
                snapshot.append((name, s.reference[:filled].copy(), filled == s.window, s.current()))
        for name, reference, complete, current in snapshot:
            if not complete or len(current) < 2:
                continue  # no verdict before the reference is whole and the current window has data
            out.append(DriftFigures(name, psi(reference, current), ks(reference, current), len(reference),
                                    len(current)))
        return out


def drift_metrics(entries, monitors):
    """``azulite_output_psi`` / ``azulite_output_ks`` / ``azulite_output_drift_values`` of the models whose
    monitor belongs to their current config (``monitors``: name -> (config, policy, monitor))."""
    from prometheus_client.core import Metric

    psi_m = Metric("azulite_output_psi", "PSI of an output's current window against its reference window", "gauge")
    ks_m = Metric("azulite_output_ks", "Two-sample KS statistic of an output's current window against its "
                  "reference window", "gauge")
    n_m = Metric("azulite_output_drift_values", "Values held in an output's drift windows", "gauge")
    for name, (config, _, monitor) in sorted(monitors.items()):
        entry = entries.get(name)
        if monitor is None or entry is None or entry.config is not config:
            continue
        for f in monitor.figures():
            labels = {"model": name, "output": f.output}
            psi_m.add_sample("azulite_output_psi", labels, f.psi)
            ks_m.add_sample("azulite_output_ks", labels, f.ks)
            n_m.add_sample("azulite_output_drift_values", {**labels, "window": "reference"}, f.reference)
            n_m.add_sample("azulite_output_drift_values", {**labels, "window": "current"}, f.current)
    yield psi_m
    yield ks_m
    yield n_m
