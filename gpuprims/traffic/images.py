"""Request bodies from real image bytes: the sample photographs scikit-image ships (no download).

`request_body(shape, dtype)` resizes a sample image to an app's input shape: HWC or CHW image
shapes (2-D grayscale too) are resized with anti-aliasing; any other shape takes the image's
pixels in order, repeated as needed. float32 bodies hold values in [0, 1], uint8 bodies 0..255.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

#: Sample images of skimage.data that ship inside the scikit-image wheel.
SAMPLE_IMAGES = ("astronaut", "chelsea", "coffee", "rocket", "camera", "cat")

_DTYPES = ("float32", "uint8", "float16")


def load_image(name: str = "astronaut") -> np.ndarray:
    """An RGB uint8 image (H, W, 3): a skimage sample by name, or an image/.npy file by path."""
    if name in SAMPLE_IMAGES:
        try:
            import skimage.data
        except ImportError as e:  # pragma: no cover - dev and CI install it
            raise ImportError("sample images need scikit-image: pip install 'gpuprims[images]'") from e
        img = getattr(skimage.data, name)()
    else:
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"image {name!r} is neither a sample ({', '.join(SAMPLE_IMAGES)}) nor a file")
        if path.suffix == ".npy":
            img = np.load(path)
        else:
            import skimage.io

            img = skimage.io.imread(path)
    img = np.asarray(img)
    if img.dtype != np.uint8:
        img = np.clip(img if img.max() > 1 else img * 255, 0, 255).astype(np.uint8)
    if img.ndim == 2:
        img = np.repeat(img[:, :, None], 3, axis=2)
    if img.ndim != 3:
        raise ValueError(f"image {name!r} has shape {img.shape}, expected (H, W) or (H, W, C)")
    return np.ascontiguousarray(img[:, :, :3])


def _layout(shape: tuple[int, ...]) -> str:
    """'hwc', 'chw', 'hw' or 'flat' for an input shape (a leading batch dim of 1 is allowed)."""
    s = shape[1:] if len(shape) == 4 and shape[0] == 1 else shape
    if len(s) == 3 and s[-1] in (1, 3, 4) and s[0] > 4:
        return "hwc"
    if len(s) == 3 and s[0] in (1, 3, 4) and s[-1] > 4:
        return "chw"
    if len(s) == 2 and min(s) > 4:
        return "hw"
    return "flat"


def request_body(shape: tuple[int, ...], dtype: str = "float32", image: str = "astronaut",
                 variant: int = 0) -> np.ndarray:
    """A request tensor of `shape` and `dtype` made from a real image.

    `variant` > 0 picks a different crop of the image, so several distinct bodies can rotate.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    if not shape or any(int(d) <= 0 for d in shape):
        raise ValueError(f"shape must be non-empty and positive, got {shape}")
    shape = tuple(int(d) for d in shape)
    img = load_image(image)
    if variant:
        h, w = img.shape[:2]
        dy, dx = (variant * 37) % max(1, h // 4), (variant * 53) % max(1, w // 4)
        img = img[dy:, dx:]
    layout = _layout(shape)
    core = shape[1:] if len(shape) == 4 else shape
    if layout == "flat":
        pixels = img.reshape(-1)
        unit = np.resize(pixels, int(np.prod(shape))).reshape(shape)
        out = unit.astype(np.float32) / 255.0 if dtype != "uint8" else unit
    else:
        from skimage.transform import resize

        if layout == "hwc":
            hw, c = core[:2], core[2]
        elif layout == "chw":
            hw, c = core[1:], core[0]
        else:
            hw, c = core, 1
        resized = resize(img, (*hw, 3), anti_aliasing=True, preserve_range=False)  # float64 in [0, 1]
        if c == 1:
            resized = resized.mean(axis=2, keepdims=True)
        elif c == 4:
            resized = np.concatenate([resized, np.ones((*hw, 1))], axis=2)
        if layout == "chw":
            resized = np.moveaxis(resized, 2, 0)
        elif layout == "hw":
            resized = resized[:, :, 0]
        out = np.round(resized * 255).astype(np.uint8) if dtype == "uint8" else resized
        out = out.reshape(shape)
    return np.ascontiguousarray(out, dtype=np.dtype(dtype))
