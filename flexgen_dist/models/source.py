"""What every source of weights is: ``WeightSource`` (hands out one part's weights under
canonical names, checked against the spec) and ``ModelLoadError``. The sources themselves
live with their formats: ``loader.py`` (Hugging Face directories, dummy weights) and
``gguf.py`` (GGUF files); this module imports neither, so they import it without a circle."""
from __future__ import annotations

import abc
from typing import Any

import torch

from .families import get_family, part_shapes
from .packed import PackedWeight
from .spec import ModelSpec


class ModelLoadError(RuntimeError):
    """A model could not be found or read; the message says what to do."""


class WeightSource(abc.ABC):
    """Hands out the weights of one part as CPU tensors of ``dtype``; a subclass reads them."""

    keep_packed = True  # get_packed keeps a file's own quantized blocks (off: expand everything)

    def __init__(self, spec: ModelSpec, dtype: torch.dtype) -> None:
        self.spec, self.dtype = spec, dtype
        self.family = get_family(spec.family)

    def shapes(self, part: str, layer: int | None = None) -> dict[str, tuple[int, ...]]:
        return part_shapes(self.spec, part, layer)

    def get(self, part: str, layer: int | None = None) -> dict[str, torch.Tensor]:
        """Weights of ``part`` ('embed', 'layer' or 'head'); ``layer`` indexes the model."""
        return self._checked(part, layer, self._read(part, layer))

    def _checked(self, part: str, layer: int | None, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``out`` in this source's dtype, each tensor's shape checked against the spec."""
        shapes = self.shapes(part, layer)
        for k, v in out.items():
            if tuple(v.shape) != tuple(shapes[k]):
                raise ModelLoadError(f"{self.spec.name}: tensor {k} of {part} {layer} has shape "
                                     f"{tuple(v.shape)}, expected {shapes[k]}: corrupt checkpoint?")
        return {k: v.to(self.dtype).contiguous() for k, v in out.items()}

    def get_packed(self, part: str, layer: int | None = None) -> dict[str, torch.Tensor | PackedWeight]:
        """Like ``get``, but a weight the file stores group-wise quantized in a form the engine
        keeps (GGUF Q4_0, Q4_1, Q8_0) comes as a ``PackedWeight``, never expanded, unless
        ``keep_packed`` is off (then every weight is expanded, as ``get``)."""
        return dict(self.get(part, layer))

    def packed_formats(self, part: str, layer: int | None = None) -> dict[str, tuple[Any, ...]]:
        """``(bits, group_size)`` of each weight ``get_packed`` keeps in the file's own blocks
        (``(8, group_size, "e4m3")`` for FP8 codes), read from the file's header alone (for the
        budget check, before anything is loaded)."""
        return {}

    @abc.abstractmethod
    def _read(self, part: str, layer: int | None) -> dict[str, torch.Tensor]:
        """The raw tensors of one part under canonical names (``get`` checks and converts)."""

    def close(self) -> None:
        """Release file handles; a source without any keeps this."""
