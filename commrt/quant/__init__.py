"""Quantized collectives (int8 / int4 block codecs), above the public API like ``train/``."""
from .codecs import Codec, codec_for, dequantize, quantize
