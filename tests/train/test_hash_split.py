"""Which rank hashes which share of which file of a restore (:mod:`azulite.train.hash_split`); that every
byte is still hashed once on a real 2-rank restore is checked in test_reader."""

from __future__ import annotations

from azulite.train.hash_split import assign_hashing


def test_whole_file_digests_split_the_hashing_evenly_and_hash_everything_once():
    a, b = ("host", "boot", 1, 10, 100, 5), ("host", "boot", 1, 11, 60, 5)
    sizes = {"a": 100, "b": 60, "c": 50, "d": 40}
    same = {"a": a, "b": b, "c": ("host", "boot", 1, 12, 50, 5), "d": ("host", "boot", 1, 13, 40, 5)}
    # DDP: both ranks read every file from the same inodes: each file hashed once, the bytes split evenly
    got = assign_hashing([same, same], sizes)
    assert all(share == (0, 1) for g in got for share in g.values())
    assert set(got[0]) | set(got[1]) == set(sizes) and not set(got[0]) & set(got[1])
    assert {sum(sizes[n] for n in g) for g in got} == {140, 110}  # greedy by size: a+d, b+c
    # a file with no identity (a Blob download: the rank's own bytes) is hashed by every rank reading it
    got = assign_hashing([{"a": None, "b": b}, {"a": None, "b": b}], sizes)
    assert got[0]["a"] == got[1]["a"] == (0, 1) and len([g for g in got if "b" in g]) == 1
    # the same name on another host (or another inode) is other bytes: each reader hashes its own
    elsewhere = ("other", "boot", 1, 10, 100, 5)
    got = assign_hashing([{"a": a}, {"a": elsewhere}, {}], sizes)
    assert got == [{"a": (0, 1)}, {"a": (0, 1)}, {}]
    # one rank alone hashes all it reads
    assert assign_hashing([same], sizes) == [{n: (0, 1) for n in sizes}]


def test_segmented_files_are_hashed_in_turns_across_the_stream():
    ident = {n: ("host", "boot", 1, i, 100, 5) for i, n in enumerate("abc")}
    sizes = {"a": 100, "b": 100, "c": 100}
    segments = {"a": 3, "b": 2, "c": 1}  # c: one segment, a file hashed whole by one reader
    got = assign_hashing([ident, ident, ident], sizes, segments)
    # the segments of a and b, in read order (a0 a1 a2 b0 b1), go to ranks 0 1 2 0 1
    owner = {}
    for rank, g in enumerate(got):
        for name in ("a", "b"):
            slot, of = g[name]
            assert of == 3
            for k in range(segments[name]):
                if k % of == slot:
                    assert (name, k) not in owner
                    owner[(name, k)] = rank
    assert [owner[("a", k)] for k in range(3)] + [owner[("b", k)] for k in range(2)] == [0, 1, 2, 0, 1]
    # c is whole-file: hashed by one reader alone
    assert [g.get("c") for g in got].count((0, 1)) == 1 and sum("c" in g for g in got) == 1
    # a rank reading its own copy of a segmented file (no identity) hashes all of it
    got = assign_hashing([{"a": None}, {"a": ident["a"]}], sizes, segments)
    assert got == [{"a": (0, 1)}, {"a": (0, 1)}]
