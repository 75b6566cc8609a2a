"""Replacement code, grouped by the Megatron area it patches. No flag parsing here."""
