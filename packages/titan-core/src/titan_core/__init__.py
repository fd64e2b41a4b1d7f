"""Titan's trainer: config schema, data, tokenizers, optimizer, metrics."""
