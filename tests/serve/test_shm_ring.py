"""The arena that carries tensors between azulite's processes: blocks reused after free (neighbours
merged), every dtype and BYTES back intact, and a tensor that does not fit goes inline, never fails."""

from __future__ import annotations

import numpy as np

from azulite.serve import shm_ring


def test_blocks_are_reused_and_merged():
    arena = shm_ring.Arena(4096)
    try:
        a, b, c = arena.alloc(1000), arena.alloc(1000), arena.alloc(1000)
        assert (a, b, c) == (0, 1024, 2048)  # 64-byte aligned
        assert arena.alloc(2000) is None  # only 1024 left at the end
        arena.free(b)
        arena.free(a)  # merged with b: one block of 2048 at 0
        assert arena.alloc(2000) == 0
        arena.free(0)
        arena.free(c)  # everything merged back
        assert arena.alloc(4096) == 0 and arena.in_use == 4096
    finally:
        arena.close()


def test_round_trip_in_place_and_inline():
    arena = shm_ring.Arena(1 << 16)
    try:
        arrays = [np.arange(12, dtype=np.float32).reshape(3, 4), np.array([True, False]),
                  np.array([[b"ab", b""], [b"\x00z", b"long" * 10]], dtype=np.object_),
                  np.asfortranarray(np.arange(6, dtype=np.int64).reshape(2, 3)),
                  np.zeros((0, 3), np.float16), np.ones(20000, np.float64)]  # the last: 160 kB > the arena
        packed = shm_ring.put(arena, arrays)
        assert [r[0] for r in packed.refs] == ["s", "s", "s", "s", "i", "i"]
        inline = memoryview(b"".join(bytes(p) for p in packed.inline))
        for array, ref in zip(arrays, packed.refs):
            back = shm_ring.take(arena.view, inline, ref, copy=True)
            assert back.dtype == array.dtype and back.shape == array.shape
            assert (back == array).all()
    finally:
        arena.close()
