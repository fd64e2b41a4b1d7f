"""Checkpoints for Titan: DCP manager, Hugging Face safetensors import/export."""
