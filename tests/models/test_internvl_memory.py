"""docs/memory.md's InternVL tables are models/internvl/memory.py's output, and its element count is the real
models': transformers' InternVLForConditionalGeneration of InternVL2.5-78B and of the 110B-class config (meta
device) has exactly as many parameters as the formula gives one rank at TP1 without pipeline splits. (The bytes
per rank are checked against measured ones in tests/vlm/test_internvl_training.py.)"""

from pathlib import Path

import pytest
import torch

from mm_adaptor.models.internvl import memory, tiny_hf_config_dict


def test_docs_tables_are_the_formulas_output(capsys):
    memory.main()
    printed = capsys.readouterr().out
    docs = (Path(__file__).parents[2] / "docs" / "memory.md").read_text()
    for table in printed.split("### ")[1:]:
        body = table.split("\n", 1)[1].strip()
        assert body in docs


@pytest.mark.parametrize("build", [memory.internvl2_5_78b, memory.internvl_110b_class])
def test_element_count_equals_transformers_model(build):
    transformers = pytest.importorskip("transformers")
    config = build()
    with torch.device("meta"):
        hf_config = transformers.InternVLConfig(**tiny_hf_config_dict(config))
        model = transformers.InternVLForConditionalGeneration(hf_config)
    assert sum(p.numel() for p in model.parameters()) == memory.stage_elements(config, 1, [config.num_layers], 0)
