"""The installed fingerprints' cache between processes: used when megatron's files are as they were, recomputed
when any changes, never kept for a definition followed into another package."""

import importlib
import os
import sys
import uuid

import pytest

from mm_adaptor.versions import fingerprint_cache, source_fingerprint


@pytest.fixture
def fresh_process(tmp_path, monkeypatch):
    """As a new process: no cache looked up yet, XDG_CACHE_HOME in tmp_path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def restart():
        monkeypatch.setattr(fingerprint_cache, "_cache", None)
        monkeypatch.setattr(fingerprint_cache, "_cache_looked_up", False)

    restart()
    return restart


@pytest.fixture
def package(tmp_path, monkeypatch, fresh_process):
    """A throwaway package standing for megatron: `a.f` defined there, `a.dumps` imported from json."""
    name = f"fakemegatron_{uuid.uuid4().hex[:10]}"
    root = tmp_path / "src" / name
    root.mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "a.py").write_text("from json import dumps\n\n\ndef f(x):\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    monkeypatch.setattr(fingerprint_cache, "PACKAGE", name)
    importlib.invalidate_caches()
    yield name, root
    for module in [m for m in sys.modules if m.split(".")[0] == name]:
        del sys.modules[module]


def test_a_later_process_reads_what_the_first_computed(fresh_process, monkeypatch):
    target = "megatron.core.tensor_parallel.layers.ColumnParallelLinear.forward"
    computed = fingerprint_cache.installed_fingerprint(target)
    assert computed and computed == source_fingerprint.installed_fingerprint(target)
    written = list((fingerprint_cache.cache_folder()).glob("*.json"))
    assert len(written) == 1 and target in written[0].read_text()
    fresh_process()
    monkeypatch.setattr(source_fingerprint, "fingerprint_target", lambda *a, **k: pytest.fail("not from the cache"))
    assert fingerprint_cache.installed_fingerprint(target) == computed


def test_an_edited_file_gives_a_new_key_and_the_new_fingerprint(package, fresh_process):
    name, root = package
    before = fingerprint_cache.installed_fingerprint(f"{name}.a.f")
    (root / "a.py").write_text("from json import dumps\n\n\ndef f(x):\n    return x + 2\n")
    fresh_process()
    after = fingerprint_cache.installed_fingerprint(f"{name}.a.f")
    assert before and after and before != after
    assert after == source_fingerprint.fingerprint_target(f"{name}.a.f", source_fingerprint.installed_source)
    assert len(list(fingerprint_cache.cache_folder().glob("*.json"))) == 2


def test_the_key_follows_each_file_s_size_and_time_and_new_files(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    key = fingerprint_cache.tree_key([str(tmp_path)])
    assert fingerprint_cache.tree_key([str(tmp_path)]) == key
    stat = (tmp_path / "a.py").stat()
    os.utime(tmp_path / "a.py", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1000))
    touched = fingerprint_cache.tree_key([str(tmp_path)])
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("")
    assert len({key, touched, fingerprint_cache.tree_key([str(tmp_path)])}) == 3


def test_a_definition_followed_into_another_package_is_not_kept(package):
    name, _ = package
    assert fingerprint_cache.installed_fingerprint(f"{name}.a.dumps")  # json's dumps
    assert fingerprint_cache.installed_fingerprint(f"{name}.a.f")
    kept = fingerprint_cache._current().entries
    assert f"{name}.a.f" in kept and f"{name}.a.dumps" not in kept
