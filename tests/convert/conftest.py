import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """(directory, tensors) of a seeded tiny untied GQA Qwen2.5-VL saved in many shards."""
    from tiny import save_tiny

    path = tmp_path_factory.mktemp("tiny_hf")
    return path, save_tiny(path)
