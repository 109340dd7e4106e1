"""Triton's response cache: with ``--cache-config local,size=BYTES`` on the server and
``response_cache { enable: true }`` in a model's config, a request whose model, version, inputs (name,
datatype, shape, bytes) and requested outputs match an earlier successful one is answered with that
answer's outputs, without running the model.

One cache for every model, bounded in bytes (the outputs' ``nbytes``), least recently used out first; an
answer larger than the whole cache is not kept. The key is a BLAKE2b digest of the request (the inputs'
bytes are hashed, never kept). Hits and misses count in the model's statistics (``cache_hit``,
``cache_miss``: the lookup's time, and for a miss the insertion's) and in Triton's per-model cache
metrics; a hit is a success and no execution (``inference_count`` / ``execution_count`` unchanged, as
Triton's). The cache lives in the data plane, so under ``--workers`` every front-end shares it.

As Triton, a decoupled model cannot cache (its load fails naming the field), and neither can a sequence
model here (its answers depend on its state, not its inputs alone). A model that enables caching on a
server without a cache loads and runs uncached, with a warning.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from azulite.errors import SpecError

_SIZE_UNITS = {"": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "g": 1 << 30, "gb": 1 << 30}


@dataclass(frozen=True)
class CacheSettings:
    size: int = 0  # bytes; 0: no cache


def parse_cache_config(items: list[str] | tuple[str, ...]) -> CacheSettings:
    """Triton's ``--cache-config local,size=BYTES`` (repeatable; only the ``local`` cache exists here)."""
    size = 0
    for item in items:
        cache, _, setting = item.partition(",")
        key, eq, raw = setting.partition("=")
        if cache != "local":
            raise SpecError(f"'{item}': only the 'local' cache is built into azulite", field="--cache-config",
                            fix="e.g. --cache-config local,size=1048576")
        if key != "size" or not eq:
            raise SpecError(f"'{item}' is not local,size=BYTES", field="--cache-config",
                            fix="e.g. --cache-config local,size=1048576")
        text = raw.strip().lower()
        digits = text.rstrip("kmgb")
        unit = text[len(digits):]
        if not digits.isdigit() or unit not in _SIZE_UNITS:
            raise SpecError(f"size {raw!r} is not a number of bytes", field="--cache-config",
                            fix="e.g. size=1048576 or size=64MB")
        size = int(digits) * _SIZE_UNITS[unit]
    return CacheSettings(size)


class ResponseCache:
    def __init__(self, size: int) -> None:
        self.size = size
        self.used = 0
        self._entries: OrderedDict[bytes, tuple[dict[str, np.ndarray], int]] = OrderedDict()
        self.evictions = 0

    @staticmethod
    def key(model: str, version: int, inputs: dict[str, np.ndarray], outputs: frozenset[str] | None) -> bytes:
        digest = hashlib.blake2b(digest_size=20)
        digest.update(f"{model}\0{version}\0".encode())
        for name in sorted(inputs):
            array = inputs[name]
            digest.update(f"{name}\0{array.dtype.str}\0{array.shape}\0".encode())
            if array.dtype == object:  # BYTES: each element's length and bytes
                for element in array.reshape(-1):
                    data = element if isinstance(element, bytes) else str(element).encode()
                    digest.update(len(data).to_bytes(8, "little"))
                    digest.update(data)
            else:
                digest.update(np.ascontiguousarray(array).data)
        digest.update(b"\0outputs\0" + ("*" if outputs is None else "\0".join(sorted(outputs))).encode())
        return digest.digest()

    def get(self, key: bytes) -> dict[str, np.ndarray] | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: bytes, outputs: dict[str, np.ndarray]) -> None:
        kept = {}
        nbytes = 0
        for name, array in outputs.items():
            copy = np.array(array, copy=True)  # the model may reuse its buffers; the cache keeps its own
            copy.flags.writeable = False
            kept[name] = copy
            nbytes += copy.nbytes if copy.dtype != object else sum(len(e) for e in copy.reshape(-1)
                                                                    if isinstance(e, bytes)) + 8 * copy.size
        if nbytes > self.size or key in self._entries:
            return
        while self.used + nbytes > self.size:
            _, (_, freed) = self._entries.popitem(last=False)
            self.used -= freed
            self.evictions += 1
        self._entries[key] = (kept, nbytes)
        self.used += nbytes

    def __len__(self) -> int:
        return len(self._entries)


def lookup(cache: ResponseCache, model, item) -> tuple[bytes, dict[str, np.ndarray] | None, int]:
    """(key, the cached outputs or None, the lookup's ns); a hit is counted in the model's statistics."""
    t0 = time.perf_counter_ns()
    key = cache.key(model.name, model.version, item.inputs, item.outputs)
    hit = cache.get(key)
    took = time.perf_counter_ns() - t0
    if hit is not None:
        model.stats.cache_hit.add(took)
    return key, hit, took


def insert(cache: ResponseCache, model, key: bytes, outputs: dict[str, np.ndarray], lookup_ns: int) -> None:
    """Keep a miss's answer; the miss counts its lookup and this insertion, as Triton's does."""
    t0 = time.perf_counter_ns()
    cache.put(key, outputs)
    model.stats.cache_miss.add(lookup_ns + time.perf_counter_ns() - t0)


def cache_metrics(all_stats, cache: ResponseCache):
    """Triton's per-model response cache metrics (reported only when the server has a cache, as Triton's),
    and the cache's own fill."""
    from prometheus_client.core import Metric

    stats = list(all_stats())
    for name, doc, get in (
        ("nv_cache_num_hits_per_model", "Number of cache hits per model", lambda s: s.cache_hit.count),
        ("nv_cache_num_misses_per_model", "Number of cache misses per model", lambda s: s.cache_miss.count),
        ("nv_cache_hit_duration_per_model", "Total cache hit duration per model, in microseconds",
         lambda s: s.cache_hit.ns // 1000),
        ("nv_cache_miss_duration_per_model", "Total cache miss (insert+miss) duration per model, in microseconds",
         lambda s: s.cache_miss.ns // 1000),
    ):
        metric = Metric(name, doc, "counter")
        for s in stats:
            metric.add_sample(name, {"model": s.name, "version": s.version}, get(s))
        yield metric
    for name, doc, value in (("azulite_response_cache_bytes", "Bytes the response cache holds", cache.used),
                             ("azulite_response_cache_entries", "Answers the response cache holds", len(cache)),
                             ("azulite_response_cache_evictions_total", "Answers evicted to make room",
                              cache.evictions)):
        metric = Metric(name.removesuffix("_total"), doc, "counter" if name.endswith("_total") else "gauge")
        metric.add_sample(name, {}, value)
        yield metric
