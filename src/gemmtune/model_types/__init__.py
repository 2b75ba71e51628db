"""The architecture registry: what gemmtune knows about each Hugging Face model type (the layout
optimize() rewrites, the GEMM shapes its config gives, its config class names), one entry per type
(registry.py). Adding an architecture is one entry there: docs/extending.md."""

from .config import ModelConfigError
from .entry import Architecture, Experts, ModelType
from .epilogue_layout import EpilogueLayout
from .registry import BY_CLASS, REGISTRY, model_type_of, text_config
from .shapes import BatchedShape, LinearShape

__all__ = [
    "BY_CLASS",
    "REGISTRY",
    "Architecture",
    "BatchedShape",
    "EpilogueLayout",
    "Experts",
    "LinearShape",
    "ModelConfigError",
    "ModelType",
    "model_type_of",
    "text_config",
]
