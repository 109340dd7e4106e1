"""Writes the two binary models of this repository: add_sub_onnx/1/model.onnx and add_sub_pt/1/model.pt
(both committed, so `azulite serve examples/model_repository` works on a fresh clone; run this again after
changing them). Each computes OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1 on FP32 [batch, 16].

    python examples/model_repository/generate.py
"""

from __future__ import annotations

import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent


def write_onnx(path: Path) -> None:
    from onnx import TensorProto, helper

    shape = ["batch", 16]
    graph = helper.make_graph(
        [helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
         helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])],
        "add_sub",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("INPUT0", "INPUT1")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("OUTPUT0", "OUTPUT1")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="azulite-example")
    model.ir_version = 8  # readable by the ONNX Runtime of Triton 2.5x too
    path.write_bytes(model.SerializeToString())


def write_torchscript(path: Path) -> None:
    import torch

    class AddSub(torch.nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x + y, x - y

    with warnings.catch_warnings():  # torch 2.13 deprecates jit.script; Triton's libtorch backend needs it
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script(AddSub()).save(str(path))


if __name__ == "__main__":
    write_onnx(HERE / "add_sub_onnx" / "1" / "model.onnx")
    write_torchscript(HERE / "add_sub_pt" / "1" / "model.pt")
    print(f"wrote {HERE / 'add_sub_onnx/1/model.onnx'} and {HERE / 'add_sub_pt/1/model.pt'}")
