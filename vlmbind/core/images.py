"""Turning user images into the RGB images every model sees: one policy for files on disk and PIL images in memory.

Design: a model batch is built from 8-bit RGB images, so every image is normalised here once, the same way wherever it
comes from (``VLM.prepare``, :func:`~vlmbind.stimuli.user_images`, a saved data set). Greyscale (``L``), CMYK,
palette and 16-bit images are converted; images with transparency (``RGBA``, ``LA``, ``PA``, a palette with a
transparent colour) are composited on white, the background the stimuli are drawn on, because the colour under a
transparent pixel is arbitrary and dropping the alpha channel would show it. Animated images (GIF, APNG, WebP) are
refused: a model sees one picture, and silently analysing the first frame of a clip would misreport what was shown;
pass the frame you mean (``im.seek(k); im.convert("RGB")``). Unreadable, truncated and decompression-bomb files are
refused with an :class:`~vlmbind.core.errors.InputError` that names the file.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from .errors import InputError

_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
_HIGH_DEPTH_MODES = ("I;16", "I;16B", "I;16L", "I", "F")


def to_rgb(image: Image.Image, name: str = "image") -> Image.Image:
    """``image`` as an 8-bit RGB image (the same object when it already is one).

    Args:
        image: a PIL image of any still mode.
        name: how the message refers to the image (e.g. ``"example 3"`` or a file name).

    Returns:
        An ``RGB`` image of the same size: transparency composited on white, greyscale / CMYK / palette converted,
        16-bit and float greyscale scaled to 8 bits.

    Raises:
        InputError: the image is animated (more than one frame).
    """
    frames = getattr(image, "n_frames", 1)
    if getattr(image, "is_animated", False) or frames > 1:
        raise InputError(f"{name} is animated ({frames} frames); vlmbind takes still images: pass one frame, e.g. "
                         "im.seek(0); im.convert('RGB')")
    if image.mode == "RGB":
        return image
    if image.mode in _ALPHA_MODES or (image.mode == "P" and "transparency" in image.info):
        # the colour under a transparent pixel is arbitrary: composite on white, the stimuli's background
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, "white"), rgba).convert("RGB")
    if image.mode in _HIGH_DEPTH_MODES:
        # convert() would clip 16-bit values at 255: scale the range to 8 bits instead
        arr = np.asarray(image, dtype=np.float64)
        span = float(arr.max() - arr.min()) or 1.0
        image = Image.fromarray(((arr - arr.min()) / span * 255).astype(np.uint8), "L")
    return image.convert("RGB")


def read_image(path: str | os.PathLike, error: type[InputError] = InputError) -> Image.Image:
    """Read an image file fully into memory as RGB (see :func:`to_rgb`).

    Args:
        path: the image file.
        error: the :class:`~vlmbind.core.errors.InputError` subclass to raise (e.g. ``StimulusError`` for data sets).

    Raises:
        InputError: (or ``error``) the file is missing, not an image, truncated, animated, or decodes to more pixels
            than Pillow allows (``Image.MAX_IMAGE_PIXELS``: a decompression bomb).
    """
    path = Path(path)
    try:
        with warnings.catch_warnings():
            # past MAX_IMAGE_PIXELS Pillow only warns (it raises past twice that): refuse both
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as im:
                im.load()
                rgb = to_rgb(im, path.name)
                # closing the file destroys an image that was already RGB: keep a copy
                return rgb.copy() if rgb is im else rgb
    except InputError as exc:
        raise (exc if isinstance(exc, error) else error(str(exc))) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise error(f"{path.name}: image is too large to decode safely ({exc}); downscale it first") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        # SyntaxError / ValueError: some Pillow decoders report a malformed header this way
        raise error(f"{path.name}: not a readable image ({exc}); remove or replace the file") from None
