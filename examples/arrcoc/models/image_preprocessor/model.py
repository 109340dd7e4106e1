"""image_preprocessor: encoded image bytes (PNG, JPEG, ... anything Pillow reads) -> the pipeline's input,
sRGB in [0, 1] as FP32 [3, 64, 64].

Pillow's BOX filter averages the source pixels under each output pixel: for the shipped 128x128 images
that is an exact 2x2 mean, the same as the training data went through (build_repository.py imports
``to_model_input`` from here, so training and serving share this one preprocessing).
"""

import io
import warnings

import numpy as np
from PIL import Image, UnidentifiedImageError

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # imported by the training script for to_model_input(), outside a server
    pb_utils = None

SIZE = 64
#: the most pixels an image may have: a 24 KB PNG can declare 14000 x 14000 (196 MP), and decoding it costs
#: hundreds of MB and seconds for a 64 x 64 input; 16 MP takes any camera photo of today
MAX_PIXELS = 4096 * 4096


def to_model_input(image: Image.Image) -> np.ndarray:
    rgb = image.convert("RGB").resize((SIZE, SIZE), Image.BOX)
    return np.ascontiguousarray(np.asarray(rgb, dtype=np.float32).transpose(2, 0, 1) / np.float32(255))


def decode(data: bytes) -> np.ndarray:
    """Raises ValueError naming what is wrong with the bytes."""
    if not data:
        raise ValueError("RAW_IMAGE is empty: send the encoded image file's bytes (PNG or JPEG) as UINT8")
    try:
        with warnings.catch_warnings():  # Pillow's own bomb check: a warning past 89 MP, an error past 179
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:  # reads the header only
                width, height = image.size
                if width * height > MAX_PIXELS:
                    raise ValueError(f"RAW_IMAGE is {width} x {height} pixels, more than the {MAX_PIXELS:,} this "
                                     f"model decodes: send it scaled down (the model sees {SIZE} x {SIZE})")
                image.load()
                return to_model_input(image)
    except UnidentifiedImageError:
        reason = "no image format Pillow reads starts so"
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        reason = str(exc)
    except ValueError as exc:
        if str(exc).startswith("RAW_IMAGE is"):
            raise
        reason = str(exc)
    except (OSError, SyntaxError) as exc:  # a known format, broken (truncated, bad chunk...)
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
