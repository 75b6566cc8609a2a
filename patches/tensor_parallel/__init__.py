"""Patches of megatron.core.tensor_parallel."""
