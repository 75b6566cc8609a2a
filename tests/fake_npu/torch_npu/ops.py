"""FAKE torch_npu ops (reference math), filled in below."""

__all__: list[str] = []
