import pytest

pytest.importorskip("PIL")


@pytest.fixture(scope="session")
def shapes(tmp_path_factory):
    """16 generated samples (messages JSON + PNGs), shared by the data tests."""
    from mm_adaptor.data.shapes import make_shapes

    return make_shapes(str(tmp_path_factory.mktemp("shapes")), count=16, seed=3)


@pytest.fixture(scope="session")
def byte_setup():
    from mm_adaptor.data import load_tokenizer, model_token_ids
    from mm_adaptor.models.qwen2_5_vl import tiny_config

    tokenizer = load_tokenizer(None)
    return tokenizer, tiny_config(**model_token_ids(tokenizer))

