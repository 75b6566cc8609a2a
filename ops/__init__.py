"""Native ops extension (custom operators in the `mm_adaptor` namespace). Lands with the native-ops issue."""


def status() -> dict:
    """What `mm-adaptor report` shows for the native ops."""
    return {"built": False, "ops": {}, "note": "no native ops yet: the ops extension is a later milestone"}
