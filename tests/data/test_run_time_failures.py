"""A sample that fails to load while training (its image damaged or gone since validation): skipped for the next
sample that loads, said and counted up to --skip-bad-samples N; past N, or without the flag, the run stops naming
the records."""

import json
import os
import shutil

import pytest

from mm_adaptor.data import DataError, build
from tests.data.damaged import undecodable_png

SEQ = 320


@pytest.fixture()
def data(tmp_path, shapes):
    """8 records, one image each; the images of records 3 and 6 decode no more (their checksums still pass)."""
    source = os.path.join(os.path.dirname(shapes), "images")
    records = json.load(open(shapes))[:8]
    for n, record in enumerate(records):
        name = f"{n}.png"
        shutil.copy(os.path.join(source, os.path.basename(record["images"][0])), tmp_path / name)
        record["images"] = [name]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _damage(folder, *numbers):
    for n in numbers:
        undecodable_png(os.path.join(folder, f"{n}.png"))


def _all_batches(batches, count, capsys):
    seen = [int(next(batches)["sample_index"][0]) for _ in range(count)]
    return seen, [line for line in capsys.readouterr().out.splitlines() if line.startswith("data: skipped")]


def test_a_damaged_sample_is_skipped_for_the_next_one_said_and_counted(data, byte_setup, tmp_path, capsys):
    tokenizer, config = byte_setup
    clean, _ = _all_batches(build(data, tokenizer, config, SEQ, global_batch_size=1, seed=5,
                                  cache_dir=tmp_path / "index"), 8, capsys)
    _damage(tmp_path, 2)  # record 3 (line 3, sample 2)
    batches = build(data, tokenizer, config, SEQ, global_batch_size=1, seed=5, skip_bad_samples=1,
                    cache_dir=tmp_path / "index")
    seen, said = _all_batches(batches, 8, capsys)
    assert seen == [(i + 1) % 8 if i == 2 else i for i in clean]  # sample 2 read as sample 3, the rest as before
    assert len(batches.failed) == 1
    assert said == [f"data: skipped {data} line 3: OSError: broken data stream when reading image file "
                    "(1 of at most 1)"]


def test_without_the_flag_or_past_its_count_the_run_stops_naming_the_records(data, byte_setup, tmp_path):
    tokenizer, config = byte_setup
    _damage(tmp_path, 2, 5)
    strict = build(data, tokenizer, config, SEQ, global_batch_size=8, micro_batch_size=8,
                   cache_dir=tmp_path / "index")
    with pytest.raises(DataError, match=rf"a sample failed to load while training: {data} line [36]: OSError: "
                                        r"broken data stream .* \(--skip-bad-samples N skips up to N of them\)"):
        next(strict)
    one = build(data, tokenizer, config, SEQ, global_batch_size=8, micro_batch_size=8, skip_bad_samples=1,
                cache_dir=tmp_path / "index")
    with pytest.raises(DataError, match=rf"2 samples failed to load while training, more than --skip-bad-samples 1: "
                                        rf"{data} line \d: .*; {data} line \d: "):
        next(one)


def test_a_sample_gone_since_validation_is_skipped_with_its_record(data, byte_setup, tmp_path, capsys):
    tokenizer, config = byte_setup
    batches = build(data, tokenizer, config, SEQ, global_batch_size=8, micro_batch_size=8, skip_bad_samples=True,
                    cache_dir=tmp_path / "index")
    os.remove(tmp_path / "4.png")
    batch = next(batches)
    assert sorted(int(i) for i in batch["sample_index"]).count(5) == 2 and len(batches.failed) == 1
    said = capsys.readouterr().out
    assert "line 5: FileNotFoundError" in said and said.endswith("(1 of at most 100)\n")
