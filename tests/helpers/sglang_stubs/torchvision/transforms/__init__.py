import enum

from torchvision import _unavailable


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def __getattr__(name):  # Compose, Resize, Normalize, ...: only called by multimodal models
    if name.startswith("__"):
        raise AttributeError(name)
    return _unavailable
