import pytest


@pytest.fixture(scope="session")
def shapes(tmp_path_factory):
    """The generated shapes dataset (mm_adaptor.data), 16 samples."""
    pytest.importorskip("PIL")
    from mm_adaptor.data.shapes import make_shapes

    return make_shapes(str(tmp_path_factory.mktemp("shapes")), count=16, seed=0)
