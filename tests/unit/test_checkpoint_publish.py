"""The marker only ever names a complete checkpoint, also when a save of the same iteration replaces one."""

from mm_adaptor.harness.runner import checkpoint_files as checkpoint
from mm_adaptor.harness.runner.arguments import checkpoint_iteration


def _save_dir(root, name, content):
    path = root / name
    path.mkdir()
    (path / "shard").write_text(content)
    return path


def test_a_save_of_the_same_iteration_replaces_the_old_one(tmp_path):
    final = _save_dir(tmp_path, "iter_0000020", "old")
    staging = _save_dir(tmp_path, "iter_0000020.saving", "new")
    checkpoint.publish(staging, final)
    assert (final / "shard").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000020"]


def test_a_replacement_cut_between_its_renames_leaves_the_old_save_loadable(tmp_path):
    (tmp_path / checkpoint.MARKER).write_text("20")
    set_aside = _save_dir(tmp_path, "iter_0000020.old", "old")  # renamed away; the new one not yet in place
    _save_dir(tmp_path, "iter_0000020.saving", "new")
    assert checkpoint.latest_checkpoint(tmp_path) == set_aside
    assert checkpoint_iteration(str(tmp_path)) == 20
    checkpoint.publish(tmp_path / "iter_0000020.saving", tmp_path / "iter_0000020")  # the next save tidies up
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000020", checkpoint.MARKER]
    assert checkpoint.latest_checkpoint(tmp_path) == tmp_path / "iter_0000020"


def test_no_marker_means_no_checkpoint(tmp_path):
    _save_dir(tmp_path, "iter_0000004", "complete but never published")
    assert checkpoint.latest_checkpoint(tmp_path) is None
