"""Decoder built only from nemo_rz.ops, and Hugging Face checkpoint I/O (json + safetensors; no transformers)."""
from nemo_rz.models.config import DecoderConfig
from nemo_rz.models.decoder import Decoder, KVCache
from nemo_rz.models.hf import ModelFileError, config_from_hf, hf_config, load_hf, save_hf

__all__ = ["Decoder", "DecoderConfig", "KVCache", "ModelFileError", "config_from_hf", "hf_config", "load_hf", "save_hf"]
