"""image_preprocessor: encoded image bytes (PNG, JPEG, ... anything Pillow reads) -> the pipeline's input,
sRGB in [0, 1] as FP32 [3, 64, 64].

Pillow's BOX filter averages the source pixels under each output pixel: for the shipped 128x128 images
that is an exact 2x2 mean, the same as the training data went through (build_repository.py imports
``to_model_input`` from here, so training and serving share this one preprocessing).
"""

import io

import numpy as np
from PIL import Image, UnidentifiedImageError

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # imported by the training script for to_model_input(), outside a server
    pb_utils = None

SIZE = 64


def to_model_input(image: Image.Image) -> np.ndarray:
    rgb = image.convert("RGB").resize((SIZE, SIZE), Image.BOX)
    return np.ascontiguousarray(np.asarray(rgb, dtype=np.float32).transpose(2, 0, 1) / np.float32(255))


def decode(data: bytes) -> np.ndarray:
    """Raises ValueError naming what is wrong with the bytes."""
    if not data:
        raise ValueError("RAW_IMAGE is empty: send the encoded image file's bytes (PNG or JPEG) as UINT8")
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            return to_model_input(image)
    except UnidentifiedImageError:
        reason = "no image format Pillow reads starts so"
    except (OSError, SyntaxError, ValueError) as exc:  # a known format, broken (truncated, bad chunk...)
        reason = str(exc)
    raise ValueError(f"RAW_IMAGE ({len(data)} bytes, starting {data[:8]!r}) is not an image Pillow can decode "
                     f"({reason}): send the bytes of a PNG or JPEG file as UINT8")


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            raw = pb_utils.get_input_tensor_by_name(request, "raw_bytes").as_numpy()
            try:
                images = np.stack([decode(row.tobytes()) for row in raw.reshape(raw.shape[0], -1)])
            except ValueError as exc:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)))
                continue
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("preprocessed_image", images)]))
        return responses
