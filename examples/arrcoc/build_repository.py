"""Train ARR-COC's small models on scenes generated here, export its ONNX steps and write the Triton model
repository (README, "ARR-COC"):

    python examples/arrcoc/build_repository.py --out DIR                  # for azulite serve
    python examples/arrcoc/build_repository.py --out DIR --triton-python  # ONNX steps as Python-backend
                                                                          # wrappers, for a Triton without
                                                                          # the onnxruntime backend
    python examples/arrcoc/build_repository.py --images                   # redraw examples/arrcoc/images/

What is trained (no weights are downloaded; a seed makes the run repeatable): the text embedding and the
participatory scorer learn together which patches hold the shape whose colour a query names, in any of
its words ("crimson" = "red"); the decoder learns to answer that shape's colour, kind and 3x3 cell from
the patches the token budget funds. The models are checked on fresh scenes (printed as heldout_accuracy)
and every exported ONNX file against its torch module. DIR may already hold other models; this script's
models are written to a temporary folder first and renamed into DIR only once all are built.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import nets  # noqa: E402
import scenes  # noqa: E402

MODELS = HERE / "models"
IMAGES = HERE / "images"
MAX_BATCH_SIZE = 32
ONNX_TOLERANCE = 1e-4  # max |onnxruntime - torch| accepted for the exported float outputs


def load_model_py(name: str):
    """A Python-backend model.py of this example, imported for its pure functions (no server needed)."""
    spec = importlib.util.spec_from_file_location(f"arrcoc_{name}", MODELS / name / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


preprocessor = load_model_py("image_preprocessor")
tokenizer = load_model_py("query_tokenizer")
opponent = load_model_py("opponent_processor")
detokenizer = load_model_py("detokenizer")


def query_vocab() -> dict[str, int]:
    return {"<pad>": tokenizer.PAD, "<unk>": tokenizer.UNKNOWN,
            **{w: i + 2 for i, w in enumerate(scenes.query_words())}}


ANSWER_IDS = {w: i for i, w in enumerate(scenes.ANSWER_WORDS)}


@dataclass
class Pool:
    images: torch.Tensor   # [n, 3, 64, 64], what image_preprocessor serves
    texture: torch.Tensor  # [n, 13, 64, 64]
    token_ids: torch.Tensor  # [n, 8]
    masks: torch.Tensor    # [n, 8, 8]: the fraction of each patch the queried shape covers
    answers: torch.Tensor  # [n, 5]
    texts: list[str]


def make_pool(rng: np.random.Generator, n: int, texture_net: nets.TextureArray, vocab: dict) -> Pool:
    images, ids, masks, answers, texts = [], [], [], [], []
    for _ in range(n):
        image, query, target = scenes.sample(rng)
        images.append(preprocessor.to_model_input(Image.fromarray(image)))
        ids.append(tokenizer.tokenize(query, vocab))
        masks.append(scenes.patch_mask(target, nets.GRID))
        answer = target.answer()
        answers.append([ANSWER_IDS[w] for w in answer.split()] + [ANSWER_IDS["<eos>"]])
        texts.append(answer)
    batch = torch.from_numpy(np.stack(images))
    with torch.no_grad():
        texture = torch.cat([texture_net(chunk) for chunk in batch.split(256)])
    return Pool(batch, texture, torch.from_numpy(np.stack(ids)), torch.from_numpy(np.stack(masks)).float(),
                torch.tensor(answers), texts)


@dataclass
class Trained:
    texture: nets.TextureArray
    propositional: nets.PropositionalScorer
    perspectival: nets.PerspectivalScorer
    embedding: nets.TextEmbedding
    participatory: nets.ParticipatoryScorer
    decoder: nets.Decoder
    vocab: dict
    heldout_accuracy: float
    #: the share of held-out answers right in each word: colour, shape, row, column
    heldout_word_accuracy: dict[str, float]
    heldout_relevance_hit: float
    train_seconds: float


def budgets(pool: Pool, embedding, participatory) -> torch.Tensor:
    """The token budgets the served pipeline gives this pool (the opponent processor's own numpy code)."""
    prop, persp = nets.PropositionalScorer(), nets.PerspectivalScorer()
    with torch.no_grad():
        q = embedding(pool.token_ids)
        scores = [s.numpy() for s in (prop(pool.texture), persp(pool.texture), participatory(pool.texture, q))]
    _, budget = opponent.opponent_process(*scores)
    return torch.from_numpy(budget)


def train(seed: int = 0, pool_size: int = 1000, scorer_steps: int = 300, decoder_steps: int = 600,
          log=print) -> Trained:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the same weights from the same seed on any machine
    try:
        return _train(seed, pool_size, scorer_steps, decoder_steps, log)
    finally:
        torch.set_num_threads(threads)


def _train(seed: int, pool_size: int, scorer_steps: int, decoder_steps: int, log) -> Trained:
    start = time.monotonic()
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    vocab = query_vocab()
    texture_net = nets.TextureArray().eval()
    pool = make_pool(rng, pool_size, texture_net, vocab)
    heldout = make_pool(rng, 200, texture_net, vocab)
    log(f"generated {pool_size} training and 200 held-out scenes in {time.monotonic() - start:.1f} s")

    # Stage 1: the text embedding and the participatory scorer learn, together, where the named colour is.
    embedding, participatory = nets.TextEmbedding(len(vocab)), nets.ParticipatoryScorer()
    # The loss is a softmax over the 64 patches against the shape's patches: the opponent processor
    # standardises the scores and exponentiates them, so what must be learnt is which patches come top.
    params = [*embedding.parameters(), *participatory.parameters()]
    opt = torch.optim.Adam(params, lr=1e-2)
    for step in range(scorer_steps):
        idx = torch.from_numpy(rng.integers(0, pool_size, 64))
        logits = participatory(pool.texture[idx], embedding(pool.token_ids[idx])).flatten(1)
        target = pool.masks[idx].flatten(1)
        target = target / target.sum(1, keepdim=True).clamp_min(1)
        loss = -(target * torch.log_softmax(logits, 1)).sum(1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == scorer_steps - 1:
            log(f"scorer step {step}: loss {loss.item():.4f}")
    embedding.eval(), participatory.eval()

    # Stage 2: the decoder reads the patches the served opponent processor funds and names what is there.
    budget = budgets(pool, embedding, participatory)
    with torch.no_grad():
        q = embedding(pool.token_ids)
    decoder = nets.Decoder(len(scenes.ANSWER_WORDS), scenes.ANSWER_LENGTH)
    opt = torch.optim.Adam(decoder.parameters(), lr=5e-3)
    for step in range(decoder_steps):
        idx = torch.from_numpy(rng.integers(0, pool_size, 64))
        logits = decoder.teacher_forced(pool.texture[idx], budget[idx], q[idx], pool.answers[idx])
        loss = F.cross_entropy(logits.flatten(0, 1), pool.answers[idx].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == decoder_steps - 1:
            log(f"decoder step {step}: loss {loss.item():.4f}")
    decoder.eval()

    # Held out: fresh scenes through the whole pipeline as served (greedy decoding, detokenized).
    hb = budgets(heldout, embedding, participatory)
    with torch.no_grad():
        ids = decoder(heldout.texture, hb, embedding(heldout.token_ids))
    said = [detokenizer.detokenize(row, scenes.ANSWER_WORDS) for row in ids.numpy()]
    accuracy = float(np.mean([a == b for a, b in zip(said, heldout.texts)]))
    words = [(a.split() + [""] * 4)[:4] for a in said]
    per_word = {kind: round(float(np.mean([w[i] == t.split()[i] for w, t in zip(words, heldout.texts)])), 3)
                for i, kind in enumerate(("colour", "shape", "row", "column"))}
    top = hb.flatten(1).argmax(1)
    hit = float((heldout.masks.flatten(1).gather(1, top[:, None]) >= 0.1).float().mean())
    log(f"held out: {accuracy:.1%} of answers exact (per word: {per_word}); the top-budget patch is on the "
        f"queried shape (>= 10% of it) in {hit:.1%}")
    return Trained(texture_net, nets.PropositionalScorer(), nets.PerspectivalScorer(), embedding, participatory,
                   decoder, vocab, accuracy, per_word, hit, time.monotonic() - start)


# --- export ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # config data_type without TYPE_
    dims: tuple[int, ...]


ONNX_STEPS = {  # model name -> (inputs, outputs); every ONNX step batches on its first dimension
    "texture_array": ([Tensor("image", "FP32", (3, 64, 64))], [Tensor("texture", "FP32", (13, 64, 64))]),
    "propositional_scorer": ([Tensor("texture", "FP32", (13, 64, 64))], [Tensor("scores", "FP32", (8, 8))]),
    "perspectival_scorer": ([Tensor("texture", "FP32", (13, 64, 64))], [Tensor("scores", "FP32", (8, 8))]),
    "text_embedding": ([Tensor("token_ids", "INT64", (8,))], [Tensor("embedding", "FP32", (16,))]),
    "participatory_scorer": ([Tensor("texture", "FP32", (13, 64, 64)), Tensor("embedding", "FP32", (16,))],
                             [Tensor("scores", "FP32", (8, 8))]),
    "decoder": ([Tensor("texture", "FP32", (13, 64, 64)), Tensor("token_budget", "INT32", (8, 8)),
                 Tensor("embedding", "FP32", (16,))], [Tensor("token_ids", "INT64", (5,))]),
}
PYTHON_STEPS = {
    "image_preprocessor": ([Tensor("raw_bytes", "UINT8", (-1,))], [Tensor("preprocessed_image", "FP32", (3, 64, 64))]),
    "query_tokenizer": ([Tensor("text", "STRING", (1,))], [Tensor("token_ids", "INT64", (8,))]),
    "opponent_processor": ([Tensor(n, "FP32", (8, 8)) for n in ("propositional", "perspectival", "participatory")],
                           [Tensor("relevance_map", "FP32", (8, 8)), Tensor("token_budget", "INT32", (8, 8))]),
    "detokenizer": ([Tensor("token_ids", "INT64", (5,))], [Tensor("text", "STRING", (1,))]),
}
ENSEMBLES = ("vlm_model", "arrcoc", "vlm_ensemble")
ALL_MODELS = (*ONNX_STEPS, *PYTHON_STEPS, *ENSEMBLES)


def config_text(name: str, backend_line: str, inputs: list[Tensor], outputs: list[Tensor], onnx: bool) -> str:
    def tensors(ts: list[Tensor]) -> str:
        return ",\n".join(f'  {{ name: "{t.name}" data_type: TYPE_{t.dtype} dims: [ {", ".join(map(str, t.dims))} ] }}'
                          for t in ts)

    text = (f'name: "{name}"\n{backend_line}\nmax_batch_size: {MAX_BATCH_SIZE}\n'
            f"input [\n{tensors(inputs)}\n]\noutput [\n{tensors(outputs)}\n]\n"
            "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
            "dynamic_batching { max_queue_delay_microseconds: 100 }\n")
    if onnx:  # one thread each: the same floats in azulite and in Triton's wrapper (and on any machine)
        text += ('parameters { key: "intra_op_thread_count" value { string_value: "1" } }\n'
                 'parameters { key: "inter_op_thread_count" value { string_value: "1" } }\n')
    return text


def sample_inputs(t: Trained, batch: int = 3) -> dict[str, tuple[torch.Tensor, ...]]:
    rng = np.random.default_rng(1234)
    pool = make_pool(rng, batch, t.texture, t.vocab)
    with torch.no_grad():
        q = t.embedding(pool.token_ids)
    budget = budgets(pool, t.embedding, t.participatory)
    return {
        "texture_array": (pool.images,),
        "propositional_scorer": (pool.texture,),
        "perspectival_scorer": (pool.texture,),
        "text_embedding": (pool.token_ids,),
        "participatory_scorer": (pool.texture, q),
        "decoder": (pool.texture, budget, q),
    }


def export_onnx(module: torch.nn.Module, args: tuple, path: Path, inputs: list[Tensor], outputs: list[Tensor]) -> float:
    """torch.onnx's dynamo exporter (torch.export + onnxscript, torch 2.13's default): the legacy
    TorchScript exporter is deprecated, and torch.export keeps the decoder's unrolled loop and the
    texture math as plain ops. Returns max |onnxruntime - torch| on ``args`` (ids must match exactly)."""
    import onnxruntime as ort

    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH_SIZE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), dynamo=True, verbose=False,
                          input_names=[t.name for t in inputs], output_names=[t.name for t in outputs],
                          dynamic_shapes=tuple({0: batch} for _ in inputs))
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
    got = session.run(None, {t.name: a.numpy() for t, a in zip(inputs, args)})[0]
    with torch.no_grad():
        want = module(*args).numpy()
    if got.shape != want.shape or got.dtype != want.dtype:
        raise SystemExit(f"{path}: onnxruntime gives {got.dtype}{list(got.shape)}, torch {want.dtype}{list(want.shape)}")
    if want.dtype.kind in "iu":
        if not np.array_equal(got, want):
            raise SystemExit(f"{path}: onnxruntime's ids differ from torch's: {got} vs {want}")
        return 0.0
    error = float(np.abs(got - want).max())
    if error > ONNX_TOLERANCE:
        raise SystemExit(f"{path}: onnxruntime differs from torch by {error:.3g} > {ONNX_TOLERANCE}")
    return error


def write_models(stage: Path, t: Trained, log=print) -> dict[str, float]:
    """The repository azulite serves (ONNX steps on the onnxruntime_onnx platform) into ``stage``."""
    errors = {}
    modules = {"texture_array": t.texture, "propositional_scorer": t.propositional,
               "perspectival_scorer": t.perspectival, "text_embedding": t.embedding,
               "participatory_scorer": t.participatory, "decoder": t.decoder}
    samples = sample_inputs(t)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    for name, (inputs, outputs) in ONNX_STEPS.items():
        version = stage / name / "1"
        version.mkdir(parents=True)
        errors[name] = export_onnx(modules[name].eval(), samples[name], version / "model.onnx", inputs, outputs)
        (stage / name / "config.pbtxt").write_text(
            config_text(name, 'platform: "onnxruntime_onnx"', inputs, outputs, onnx=True))
        log(f"exported {name}: max |onnxruntime - torch| = {errors[name]:.2e}")
    for name, (inputs, outputs) in PYTHON_STEPS.items():
        version = stage / name / "1"
        version.mkdir(parents=True)
        shutil.copy(MODELS / name / "model.py", version / "model.py")
        (stage / name / "config.pbtxt").write_text(config_text(name, 'backend: "python"', inputs, outputs, onnx=False))
    (stage / "query_tokenizer" / "1" / "vocab.json").write_text(json.dumps(t.vocab, indent=1))
    (stage / "detokenizer" / "1" / "vocab.json").write_text(json.dumps(list(scenes.ANSWER_WORDS)))
    for name in ENSEMBLES:
        (stage / name / "1").mkdir(parents=True)  # Triton wants an ensemble's (empty) version folder
        shutil.copy(MODELS / name / "config.pbtxt", stage / name / "config.pbtxt")
    return errors


def to_triton_python(stage: Path) -> None:
    """Rewrite the ONNX steps of ``stage`` as Python-backend models running the same model.onnx."""
    for name in ONNX_STEPS:
        config = stage / name / "config.pbtxt"
        config.write_text(config.read_text().replace('platform: "onnxruntime_onnx"', 'backend: "python"'))
        shutil.copy(MODELS / "onnx_wrapper" / "model.py", stage / name / "1" / "model.py")


def _place(stage: Path, out: Path) -> None:
    for name in ALL_MODELS:
        if (out / name).exists():
            shutil.rmtree(out / name)
        (stage / name).rename(out / name)


def _check_free(out: Path, overwrite: bool) -> None:
    clash = [n for n in ALL_MODELS if (out / n).exists()]
    if clash and not overwrite:
        raise SystemExit(f"{out} already holds {', '.join(clash)}: pass --overwrite to replace them, "
                         "or choose another --out")


def _check_integrity(target: Path, sign_key: Path | None) -> None:
    """A repository with a signed integrity manifest (``azulite repo sign --key``) takes new models only
    re-signed: refused before the minutes of training, or the server would refuse every ARR-COC model."""
    from azulite.export.repository import check_integrity_before
    from azulite.errors import AzuliteError

    try:
        check_integrity_before(target, sign_key)
    except AzuliteError as exc:
        raise SystemExit(f"{exc}\n  fix: pass --sign-key PRIVATE.pem (the key `azulite repo sign --key` used), "
                         f"or write into another --out") from None


def build(out: Path, *, triton_python: bool = False, also_triton_python: Path | None = None, seed: int = 0,
          overwrite: bool = False, trained: Trained | None = None, log=print, sign_key: Path | None = None) -> dict:
    """Write the ARR-COC models into the repository ``out`` (created if missing; other models in it are
    left alone), and the --triton-python variant into ``also_triton_python`` if given. A repository with an
    integrity manifest gets its entries for the models written (re-signed with ``sign_key``), as
    ``azulite export`` does. Returns the summary the command line prints as JSON."""
    from azulite.export.repository import update_integrity

    out = out.resolve()
    targets = [out] + ([also_triton_python.resolve()] if also_triton_python else [])
    for target in targets:
        _check_free(target, overwrite)
        _check_integrity(target, sign_key)
    t = trained or train(seed, log=log)
    stages = []
    try:
        for target in targets:
            target.mkdir(parents=True, exist_ok=True)
            stages.append(Path(tempfile.mkdtemp(prefix=".arrcoc-", dir=target)))
        errors = write_models(stages[0], t, log=log)
        if also_triton_python:
            shutil.rmtree(stages[1])
            shutil.copytree(stages[0], stages[1])
            to_triton_python(stages[1])
        if triton_python:
            to_triton_python(stages[0])
        for stage, target in zip(stages, targets):  # only now, with everything built, into place
            _place(stage, target)
        integrity = [update_integrity(target, [target / n for n in ALL_MODELS], sign_key) for target in targets]
    finally:
        for stage in stages:
            shutil.rmtree(stage, ignore_errors=True)
    summary = {"repository": str(out), "models": list(ALL_MODELS), "triton_python": triton_python, "seed": seed,
               "heldout_accuracy": t.heldout_accuracy, "heldout_word_accuracy": t.heldout_word_accuracy,
               "heldout_relevance_hit": t.heldout_relevance_hit,
               "onnx_max_abs_error": errors, "train_seconds": round(t.train_seconds, 1)}
    if also_triton_python:
        summary["triton_python_repository"] = str(targets[1])
    if any(integrity):
        summary["integrity"] = [i for i in integrity if i]
    return summary


# --- shipped images ------------------------------------------------------------------------------------

def draw_images(count: int = 6, seed: int = 2026) -> list[dict]:
    """The example's images (PNG, 128x128) and a query for each, with the answer the scene was drawn with."""
    rng = np.random.default_rng(seed)
    IMAGES.mkdir(exist_ok=True)
    cases = []
    for i in range(count):
        image, query, target = scenes.sample(rng)
        name = f"scene{i}.png"
        Image.fromarray(image).save(IMAGES / name, optimize=True)
        cases.append({"image": name, "query": query, "answer": target.answer()})
    (IMAGES / "queries.json").write_text(json.dumps(cases, indent=1) + "\n")
    return cases


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="model repository folder to write the ARR-COC models into")
    ap.add_argument("--triton-python", action="store_true",
                    help="write the ONNX steps as Python-backend models running onnxruntime (for a Triton "
                         "without the onnxruntime backend)")
    ap.add_argument("--also-triton-python", type=Path, metavar="DIR",
                    help="also write the --triton-python variant of the same trained models into DIR")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overwrite", action="store_true", help="replace ARR-COC models already in --out")
    ap.add_argument("--sign-key", type=Path, metavar="PRIVATE.pem",
                    help="re-sign the repository's integrity manifest (a repository `azulite repo sign --key` signed)")
    ap.add_argument("--images", action="store_true", help="redraw examples/arrcoc/images/ (and queries.json)")
    args = ap.parse_args(argv)
    if args.images:
        print(json.dumps(draw_images()))
        return
    if args.out is None:
        ap.error("--out DIR is required (or --images)")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731 - stdout's last line is the JSON
    summary = build(args.out, triton_python=args.triton_python, also_triton_python=args.also_triton_python,
                    seed=args.seed, overwrite=args.overwrite, log=log, sign_key=args.sign_key)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
