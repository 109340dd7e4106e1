"""Which rank hashes which file of a restore (:mod:`azulite.train.hash_split`); that every byte is still
hashed once on a real 2-rank restore is checked in test_reader."""

from __future__ import annotations

from azulite.train.hash_split import assign_hashing


def test_ranks_reading_the_same_bytes_split_the_hashing_evenly_and_hash_everything_once():
    a, b = ("host", "boot", 1, 10, 100, 5), ("host", "boot", 1, 11, 60, 5)
    sizes = {"a": 100, "b": 60, "c": 50, "d": 40}
    same = {"a": a, "b": b, "c": ("host", "boot", 1, 12, 50, 5), "d": ("host", "boot", 1, 13, 40, 5)}
    # DDP: both ranks read every file from the same inodes: each file hashed once, the bytes split evenly
    got = assign_hashing([same, same], sizes)
    assert got[0] | got[1] == set(sizes) and not got[0] & got[1]
    assert {sum(sizes[n] for n in g) for g in got} == {140, 110}  # greedy by size: a+d, b+c
    # a file with no identity (a Blob download: the rank's own bytes) is hashed by every rank reading it
    got = assign_hashing([{"a": None, "b": b}, {"a": None, "b": b}], sizes)
    assert "a" in got[0] and "a" in got[1] and len([g for g in got if "b" in g]) == 1
    # the same name on another host (or another inode) is other bytes: each reader hashes its own
    elsewhere = ("other", "boot", 1, 10, 100, 5)
    got = assign_hashing([{"a": a}, {"a": elsewhere}, {}], sizes)
    assert got == [{"a"}, {"a"}, set()]
    # one rank alone hashes all it reads
    assert assign_hashing([same], sizes) == [set(sizes)]
