"""Patches of megatron.core.pipeline_parallel (the schedules)."""
