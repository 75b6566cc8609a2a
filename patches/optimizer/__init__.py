"""Patches of megatron.core.optimizer: where the optimizer keeps its main parameters and state."""
