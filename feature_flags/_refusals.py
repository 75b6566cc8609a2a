"""Refusals several features share. Not a feature module (the leading underscore keeps discovery away)."""


def cuda_graph_flag(options) -> str | None:
    """The megatron flag that asks for CUDA graphs, as the user would write it, or None. Read with defaults: the
    built-in driver does not define these flags."""
    if getattr(options, "enable_cuda_graph", False):
        return "--enable-cuda-graph"
    if getattr(options, "external_cuda_graph", False):
        return "--external-cuda-graph"
    impl = getattr(options, "cuda_graph_impl", None)
    if impl not in (None, "none"):
        return f"--cuda-graph-impl {impl}"
    return None


def cuda_graph_refusal(main_flag: str, options) -> str | None:
    """A feature that moves tensors or frees storage on its own streams at run time cannot be captured in a CUDA
    graph: the replay would reuse the addresses and copies of the captured step."""
    graph = cuda_graph_flag(options)
    if graph is None:
        return None
    return (f"{main_flag} and {graph} cannot run together: a CUDA graph replays the captured step's allocations "
            f"and copies, while {main_flag} decides where tensors live at run time; keep one")
