"""pytest imports test files by basename (rootdir-relative, no packages): two files of one name in different
folders stop the whole suite at collection, so every test file's name is unique."""

from collections import Counter
from pathlib import Path


def test_every_test_file_name_is_unique():
    tests = Path(__file__).resolve().parents[1]
    names = Counter(path.name for path in tests.rglob("test_*.py"))
    assert names and not [name for name, count in names.items() if count > 1], names.most_common(3)
