"""The data index: built once per data and settings (a pool of processes, chunk by chunk), opened after; its
samples are the file's good records, whatever the chunking; one process builds while another waits."""

import json
import multiprocessing
import os
import pickle
import shutil
import time

import numpy as np
import pytest

from mm_adaptor.data import DataError, index as data_index, index_build, validate
from mm_adaptor.data.vlm import encode

SEQ = 320


def _record(n: int, image: str = "img.png") -> dict:
    return {"messages": [{"role": "user", "content": f"<image>Picture {n}: what is in it?"},
                         {"role": "assistant", "content": "A circle. " * (n % 7 + 1)}], "images": [image]}


@pytest.fixture()
def data(tmp_path, shapes):
    """A JSONL file of 60 records; records 7, 19 and 40 are bad (a missing image, malformed, too long)."""
    shutil.copy(os.path.join(os.path.dirname(shapes), "images", "00000.png"), tmp_path / "img.png")
    lines = []
    for n in range(1, 61):
        if n == 7:
            lines.append(json.dumps(_record(n, "gone.png")))
        elif n == 19:
            lines.append("{broken")
        elif n == 40:
            lines.append(json.dumps(_record(n) | {"messages": [{"role": "user", "content": "<image>" + "x" * 400},
                                                               {"role": "assistant", "content": "y"}]}))
        else:
            lines.append(json.dumps(_record(n), ensure_ascii=n % 2 == 0) + (" " if n % 5 == 0 else ""))
        if n == 30:
            lines.append("")  # a blank line counts as a line, not as a record
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _expected(path, tokenizer, processing):
    """(line number, record, tokens) of each good line, read without the index."""
    out = []
    grids = [processing.grid_for_size(*_size(os.path.join(os.path.dirname(path), "img.png")))]
    for number, line in enumerate(open(path, encoding="utf-8"), 1):
        if number in (7, 19, 41) or not line.strip():  # record 40 is on line 41, after the blank one
            continue
        raw = json.loads(line)
        sample = validate_one(raw, path, number)
        out.append((number, raw, len(encode(sample, grids, tokenizer, processing)[0])))
    return out


def _size(path):
    from PIL import Image

    with Image.open(path) as image:
        return image.size


def validate_one(raw, path, number):
    from mm_adaptor.data.records import parse_record

    record, error = parse_record(path, f"line {number}", raw)
    assert error is None
    return record


def _processing():
    from mm_adaptor.data.images import QWEN2_5_VL

    return QWEN2_5_VL


def _check_against_file(report, path, tokenizer):
    expected = _expected(path, tokenizer, _processing())
    assert len(report.samples) == len(expected)
    for sample, (number, raw, tokens) in zip(report.samples, expected):
        assert sample.record.where == f"line {number}"
        assert sample.record.messages == raw["messages"] and sample.length == tokens
        assert sample.grids == [_processing().grid_for_size(*_size(sample.record.images[0]))]
    assert [line.split(": ")[0] for line in report.bad] == [f"{path} line {n}" for n in (7, 19, 41)]


def test_samples_are_the_files_good_records_whatever_the_chunks(data, byte_setup, tmp_path, monkeypatch):
    tokenizer, _ = byte_setup
    whole = validate(data, tokenizer, SEQ, skip_bad_samples=True, cache_dir=tmp_path / "one")
    _check_against_file(whole, data, tokenizer)
    monkeypatch.setattr(index_build, "CHUNK_BYTES", 700)  # a dozen chunks over two processes
    pooled = validate(data, tokenizer, SEQ, skip_bad_samples=True, cache_dir=tmp_path / "pool", workers=2)
    _check_against_file(pooled, data, tokenizer)
    for name in ("spans", "lengths", "grid_offsets", "grids"):
        assert np.array_equal(getattr(whole.samples.index, name), getattr(pooled.samples.index, name)), name


def test_a_chunk_read_from_the_wrong_offset_is_caught(data, byte_setup, tmp_path, monkeypatch):
    """The broken variant: a worker whose records are shifted by one line."""
    tokenizer, _ = byte_setup
    real = index_build._index_chunk

    def shifted(task):
        part = real(task)
        part["spans"][1:] = part["spans"][:-1].copy()
        return part

    monkeypatch.setattr(index_build, "_index_chunk", shifted)
    monkeypatch.setattr(index_build, "CHUNK_BYTES", 700)
    report = validate(data, tokenizer, SEQ, skip_bad_samples=True, cache_dir=tmp_path, workers=1)
    with pytest.raises(AssertionError):
        _check_against_file(report, data, tokenizer)


def test_max_samples_counts_records_read_in_file_order(data, byte_setup, tmp_path, monkeypatch):
    tokenizer, _ = byte_setup
    monkeypatch.setattr(index_build, "CHUNK_BYTES", 700)
    report = validate(data, tokenizer, SEQ, max_samples=25, skip_bad_samples=True, cache_dir=tmp_path, workers=2)
    assert len(report.samples) + report.skipped == 25 and report.skipped == 2  # lines 7 and 19
    assert report.samples[-1].record.where == "line 25"


def test_built_once_then_opened_and_rebuilt_when_the_data_or_a_setting_changes(data, byte_setup, tmp_path,
                                                                                monkeypatch):
    tokenizer, _ = byte_setup
    first = validate(data, tokenizer, SEQ, skip_bad_samples=True, cache_dir=tmp_path)
    builds = []

    def counting(*args, **kwargs):
        builds.append(args)
        return _real_build(*args, **kwargs)

    monkeypatch.setattr(data_index, "build", counting)
    again = validate(data, tokenizer, SEQ, skip_bad_samples=True, cache_dir=tmp_path)
    assert builds == [] and again.samples.index.directory == first.samples.index.directory
    validate(data, tokenizer, SEQ + 1, skip_bad_samples=True, cache_dir=tmp_path)
    assert len(builds) == 1
    with open(data, "a") as f:
        f.write(json.dumps(_record(61)) + "\n")
    grown = validate(data, tokenizer, SEQ, skip_bad_samples=True, cache_dir=tmp_path)
    assert len(builds) == 2 and len(grown.samples) == len(first.samples) + 1


_real_build = data_index.build


def test_the_samples_travel_to_a_rank_as_their_index_directory(data, byte_setup, tmp_path):
    tokenizer, _ = byte_setup
    report = validate(data, tokenizer, SEQ, skip_bad_samples=True, cache_dir=tmp_path)
    part = report.samples[10:20]
    sent = pickle.dumps(part)
    assert len(sent) < 1000
    received = pickle.loads(sent)
    assert len(received) == 10 and received[3].record.messages == report.samples[13].record.messages
    assert report.samples[-1].record.where == report.samples[len(report.samples) - 1].record.where
    with pytest.raises(IndexError):
        part[10]


def test_a_json_list_is_indexed_as_records(shapes, byte_setup, tmp_path):
    tokenizer, _ = byte_setup
    report = validate(shapes, tokenizer, SEQ, cache_dir=tmp_path)
    records = json.load(open(shapes))
    assert [s.record.messages for s in report.samples] == [r["messages"] for r in records]
    assert report.samples[2].record.where == "record 3" and report.samples[2].record.file == shapes


def test_a_malformed_json_list_is_refused(tmp_path, byte_setup):
    path = tmp_path / "data.json"
    path.write_text('[{"messages": []},\n  oops]')
    with pytest.raises(DataError, match="malformed JSON at line 2 column 3"):
        validate(str(path), byte_setup[0], SEQ, cache_dir=tmp_path / "cache")


def _slow_build(*args, **kwargs):
    with open(os.environ["BUILD_LOG"], "a") as log:
        log.write(f"{os.getpid()}\n")
    time.sleep(1.0)
    return _real_build(*args, **kwargs)


def _open(data, cache, tokenizer, queue):
    from mm_adaptor.data.images import QWEN2_5_VL

    data_index.build = _slow_build
    index = data_index.open_or_build(data, tokenizer, SEQ, QWEN2_5_VL, cache_dir=cache, workers=1)
    queue.put(len(index))


def test_one_process_builds_while_the_others_wait(data, byte_setup, tmp_path, monkeypatch):
    monkeypatch.setenv("BUILD_LOG", str(tmp_path / "builds"))
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    procs = [context.Process(target=_open, args=(data, tmp_path / "cache", byte_setup[0], queue)) for _ in range(3)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    assert sorted(queue.get(timeout=5) for _ in procs) == [57] * 3
    assert len((tmp_path / "builds").read_text().split()) == 1


def test_prepare_builds_the_index_the_trainer_finds(data, tmp_path, capsys):
    from mm_adaptor.cli import main as cli_main

    cache = tmp_path / "cache"
    assert cli_main(["data", "prepare", data, str(cache), "--seq-length", str(SEQ), "--model", "qwen2_5_vl-tiny"]) == 0
    out, err = capsys.readouterr()
    assert "57 samples, 3 bad ones skipped" in out and "bad.txt" in out
    assert "indexing" in err and "indexed 57 samples (3 bad)" in err
    built = [p for p in cache.iterdir() if p.is_dir()]
    assert len(built) == 1 and (built[0] / "bad.txt").read_text().count("\n") == 3
    assert cli_main(["data", "prepare", data, str(cache), "--seq-length", str(SEQ), "--model", "qwen2_5_vl-tiny"]) == 0
    assert f"is at {built[0]}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:
        cli_main(["data", "prepare", data, "--seq-length", "64", "--workers", "0"])
    assert stopped.value.code == 2 and "--workers: 0: want 1 or more" in capsys.readouterr().err
