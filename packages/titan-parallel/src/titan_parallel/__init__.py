"""Composable parallelism for any PyTorch model: FSDP2/HSDP, tensor, sequence, loss, pipeline and context parallel."""
