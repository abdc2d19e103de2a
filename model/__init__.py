"""The LRA classifier and its attention masks."""
from .lra import BACKENDS, QUANTIZED, LRAClassifier, LRAConfig
from .masks import layer_mask, structured_vector_mask

__all__ = ["BACKENDS", "QUANTIZED", "LRAClassifier", "LRAConfig", "layer_mask", "structured_vector_mask"]
