"""What differs between transformers 4.57 and 5.x where the tests call it.

- The PIL/numpy Qwen2-VL image processor, the reference our preprocessing is compared with: 4.x calls it
  Qwen2VLImageProcessor; 5.x Qwen2VLImageProcessorPil (its Qwen2VLImageProcessor needs torchvision, which has no
  CPU build here).
- 5.x builds the 3-D positions from `mm_token_type_ids` (its processor's output: 1 image pad, 2 video pad, 0 text);
  called without them, its forward and generate fall back to 1-D positions, and get_rope_index requires them."""


def slow_qwen2_vl_image_processor():
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as found
    except ImportError:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor as found
    return found


def slow_module():
    """The module of that processor (its smart_resize)."""
    import importlib

    return importlib.import_module(slow_qwen2_vl_image_processor().__module__)


def hf_takes_token_types() -> bool:
    import inspect

    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    return "mm_token_type_ids" in inspect.signature(Qwen2_5_VLModel.forward).parameters


def token_types(config, input_ids):
    return (input_ids == config.image_token_id).int() + 2 * (input_ids == config.video_token_id).int()


def with_token_types(config, input_ids, **inputs) -> dict:
    """`inputs` and, where the installed transformers needs them (5.x), the token types of input_ids."""
    if hf_takes_token_types():
        inputs["mm_token_type_ids"] = token_types(config, input_ids)
    return inputs
