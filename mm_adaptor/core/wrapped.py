"""The model inside megatron's wrappers (DDP, Float16Module): what the driver, the dump, memory accounting and the
patches read. Imports nothing, so the driver's argument checks stay free of torch."""


def unwrap(chunk):
    """The megatron model inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk
