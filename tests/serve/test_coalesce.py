"""serve/coalesce.py: which requests a front-end may send to the model host as one, the one request
they become and the answers cut back out of it; the batcher's side (a Python model's execute still
sees each client request, and statistics count them)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from azulite.errors import InvalidArgument
from azulite.serve import coalesce, shm_ring
from azulite.serve.backends.base import Timing, WorkItem
from azulite.serve.batch_settings import BatcherSettings
from azulite.serve.batcher import Batcher
from azulite.serve.stats import ModelStats
from azulite.serve.types import InferRequest, InferResponse, InferTensor, RequestedOutput


def req(x: np.ndarray, *, id: str = "", model: str = "m", params: dict | None = None, outputs=None,
        name: str = "X", datatype: str = "FP32", tparams: dict | None = None) -> InferRequest:
    return InferRequest(model_name=model, inputs=[InferTensor(name, datatype, x.shape, x, tparams or {})], id=id,
                        parameters=params or {}, outputs=outputs)


def rows(n: int, start: float, width: int = 3) -> np.ndarray:
    return (np.arange(n * width, dtype=np.float32) + start).reshape(n, width)


def test_requests_that_a_batcher_would_join_share_a_key():
    a, b = req(rows(1, 0), id="a"), req(rows(2, 10), id="b")
    assert coalesce.merge_key(a) == coalesce.merge_key(b) is not None
    # anything a batch does not share keeps them apart
    assert coalesce.merge_key(req(rows(1, 0), model="other")) != coalesce.merge_key(a)
    assert coalesce.merge_key(req(rows(1, 0, width=4))) != coalesce.merge_key(a)
    assert coalesce.merge_key(req(rows(1, 0).astype(np.float64), datatype="FP64")) != coalesce.merge_key(a)
    assert coalesce.merge_key(req(rows(1, 0), params={"priority": 2})) != coalesce.merge_key(a)
    assert coalesce.merge_key(req(rows(1, 0), outputs=[RequestedOutput("Y", {})])) != coalesce.merge_key(a)


@pytest.mark.parametrize("why", ["sequence", "shm input", "shm output", "bytes", "scalar", "no rows",
                                 "unhashable parameter", "trace context"])
def test_what_is_per_request_never_coalesces(why):
    x = rows(1, 0)
    r = {
        "sequence": lambda: req(x, params={"sequence_id": 7}),
        "shm input": lambda: InferRequest(model_name="m", inputs=[InferTensor("X", "FP32", (1, 3), None, {
            "shared_memory_region": "r"})]),
        "shm output": lambda: req(x, outputs=[RequestedOutput("Y", {"shared_memory_region": "r"})]),
        "bytes": lambda: req(np.array([[b"a"]], dtype=object), datatype="BYTES"),
        "scalar": lambda: req(np.float32(1.0).reshape(())),
        "no rows": lambda: req(np.zeros((0, 3), np.float32)),
        "unhashable parameter": lambda: req(x, params={"tags": ["a"]}),
        "trace context": lambda: InferRequest(model_name="m", inputs=[InferTensor("X", "FP32", (1, 3), x)],
                                              trace_context={"traceparent": "00-1-2-01"}),
    }[why]()
    assert coalesce.merge_key(r) is None


def test_coalesced_inputs_are_one_block_per_input_and_answers_go_back_by_rows():
    arena = shm_ring.Arena(1 << 20)
    try:
        parts = [req(rows(1, 0), id="a"), req(rows(3, 100), id="b"), req(rows(2, 200), id="c")]
        packed = shm_ring.Packed()
        merged, metas = coalesce.pack_merged(arena, parts, packed)
        assert len(packed.refs) == 1 and len(packed.blocks) == 1  # one block for X's six rows
        stacked = shm_ring.take(arena.view, memoryview(b""), packed.refs[metas[0][4]], copy=True)
        assert metas[0][2] == (6, 3)
        np.testing.assert_array_equal(stacked, np.concatenate([p.inputs[0].data for p in parts]))
        split = coalesce.parts_of(parts)
        assert split == [("a", 1), ("b", 3), ("c", 2)]
        # the model's answer for the six rows, cut back: each request its own rows and its own id
        response = InferResponse(model_name="m", model_version="1", id="", parameters={"p": 1},
                                 outputs=[InferTensor("Y", "FP32", (6, 3), stacked * 2)])
        answers = coalesce.split_response(response, split)
        assert [a.id for a in answers] == ["a", "b", "c"]
        for answer, part in zip(answers, parts):
            np.testing.assert_array_equal(answer.outputs[0].data, part.inputs[0].data * 2)
            assert answer.outputs[0].shape == part.inputs[0].data.shape and answer.parameters == {"p": 1}
        assert answers[0].parameters is not answers[1].parameters
        # and a coalesced request back into its parts (the host's one-by-one path)
        whole = InferRequest(model_name="m", inputs=[InferTensor("X", "FP32", (6, 3), stacked)], parameters={"k": 1})
        again = coalesce.split_request(whole, split)
        assert [(r.id, r.inputs[0].shape) for r in again] == [("a", (1, 3)), ("b", (3, 3)), ("c", (2, 3))]
        for r, part in zip(again, parts):
            np.testing.assert_array_equal(r.inputs[0].data, part.inputs[0].data)
    finally:
        arena.close()


def item(x: np.ndarray, parts=None) -> WorkItem:
    it = WorkItem(inputs={"X": x}, outputs=None, batch_size=x.shape[0], request_id="whole")
    if parts is not None:
        it.parts, it.requests = parts, len(parts)
    return it


def test_a_python_model_gets_each_client_request_and_its_results_are_stacked_back():
    merged = item(rows(3, 0), [("a", 1), ("b", 2)])
    alone = item(rows(1, 50))
    items, counts = coalesce.expand([alone, merged], "m")
    assert counts == [1, 2]
    assert [(i.request_id, i.batch_size) for i in items] == [("whole", 1), ("a", 1), ("b", 2)]
    results = [{"Y": i.inputs["X"] + 1} for i in items]
    out = coalesce.regroup(results, [alone, merged], counts)
    np.testing.assert_array_equal(out[1]["Y"], rows(3, 0) + 1)
    assert out[0] is results[0]
    assert coalesce.expand([alone], "m") == ([alone], None)


@pytest.mark.parametrize("irregular", ["error", "missing output", "wrong rows", "other dtype"])
def test_parts_whose_results_do_not_stack_are_answered_each_on_its_own(irregular):
    merged = item(rows(3, 0), [("a", 1), ("b", 2)])
    items, counts = coalesce.expand([merged], "m")
    results = [{"Y": i.inputs["X"] + 1} for i in items]
    if irregular == "error":
        results[1] = InvalidArgument("b is wrong")
    elif irregular == "missing output":
        results[1] = {}
    elif irregular == "wrong rows":
        results[1] = {"Y": np.zeros((5, 3), np.float32)}
    else:
        results[1] = {"Y": results[1]["Y"].astype(np.float64)}
    out = coalesce.regroup(results, [merged], counts)
    assert isinstance(out[0], coalesce.PartResults) and list(out[0]) == results


class Echo:
    inline_safe = False
    per_request = True

    def __init__(self) -> None:
        self.seen: list[list[tuple[str, int]]] = []

    def execute(self, items):
        self.seen.append([(i.request_id, i.batch_size) for i in items])
        return [{"Y": i.inputs["X"] * 2} for i in items], Timing()

    def close(self) -> None:
        pass


def test_the_batcher_counts_client_requests_and_a_python_model_never_sees_a_coalesced_one():
    async def main():
        stats = ModelStats("m", "1")
        echo = Echo()
        batcher = Batcher(model="m", settings=BatcherSettings(max_batch_size=8, dynamic=True, max_delay_ns=50_000_000,
                                                              preferred=(4,)),
                          instances=[("m_0", echo)], observer=stats)
        merged = item(rows(3, 0), [("a", 1), ("b", 2)])
        futures = [batcher.submit(merged), batcher.submit(item(rows(1, 9)))]
        assert stats.pending == 3  # client requests, not entries
        out = await asyncio.gather(*futures)
        await batcher.close()
        return stats, echo, out

    stats, echo, out = asyncio.run(main())
    assert echo.seen == [[("a", 1), ("b", 2), ("whole", 1)]]
    np.testing.assert_array_equal(out[0]["Y"], rows(3, 0) * 2)
    assert stats.pending == 0 and stats.queue.count == 3 and stats.compute_infer.count == 3
    assert stats.inference_count == 4 and stats.execution_count == 1


def test_a_group_goes_in_runs_of_at_most_the_hosts_rows():
    sizes = [3, 2, 4, 1, 9, 1]
    runs = list(coalesce.chunks(sizes, 6, lambda n: n))
    assert runs == [[3, 2], [4, 1], [9], [1]]  # a request past the limit goes alone
    assert list(coalesce.chunks(sizes, 0, lambda n: n)) == [sizes]  # the limit not known yet: one run
