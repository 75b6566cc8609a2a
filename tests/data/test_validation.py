"""The validation pass: each kind of bad record is named by file and record/line in one line; skipping counts."""

import json
import os
import shutil

import pytest

from mm_adaptor.data import DataError, build, validate
from mm_adaptor.core.errors import ConfigurationError

SEQ = 320


def _good(image="img.png", answer="2 red circles."):
    return {"messages": [{"role": "user", "content": "<image>What is in the picture?"},
                         {"role": "assistant", "content": answer}], "images": [image]}


@pytest.fixture()
def folder(tmp_path, shapes):
    shutil.copy(os.path.join(os.path.dirname(shapes), "images", "00000.png"), tmp_path / "img.png")
    (tmp_path / "broken.png").write_bytes(b"not an image at all")
    return tmp_path


BAD_LINES = {  # line number -> (JSONL line, words the report must name)
    2: ("{not json", "malformed JSON"),
    3: (json.dumps({"images": ["img.png"]}), '"messages"'),
    4: (json.dumps(_good("missing.png")), "does not exist"),
    5: (json.dumps(_good("broken.png")), "unreadable"),
    6: (json.dumps(_good() | {"images": ["img.png", "img.png"]}), "2 images for 1 <image> tags"),
    7: (json.dumps(_good(answer="long " * 100)), "longer than seq_length"),
    8: (json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}), "roles"),
}


def _jsonl(folder):
    lines = [json.dumps(_good())] + [BAD_LINES[n][0] for n in sorted(BAD_LINES)] + [json.dumps(_good())]
    path = folder / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_each_bad_kind_named_by_file_and_line(folder, byte_setup):
    tokenizer, _ = byte_setup
    path = _jsonl(folder)
    report = validate(path, tokenizer, SEQ, skip_bad_samples=True)
    assert report.skipped == len(BAD_LINES) and len(report.samples) == 2
    assert [s.record.where for s in report.samples] == ["line 1", f"line {len(BAD_LINES) + 2}"]
    for line, (number, (_, words)) in zip(report.bad, sorted(BAD_LINES.items())):
        assert line.startswith(f"{path} line {number}: ") and words in line and "\n" not in line, line


def test_bad_records_refused_in_one_error(folder, byte_setup):
    tokenizer, config = byte_setup
    with pytest.raises(DataError, match=r"7 bad samples .*line 2: malformed JSON") as caught:
        build(_jsonl(folder), tokenizer, config, SEQ)
    assert isinstance(caught.value, ConfigurationError)


def test_json_list_records_and_malformed_file(folder, byte_setup):
    tokenizer, _ = byte_setup
    path = folder / "data.json"
    path.write_text(json.dumps([_good(), _good("missing.png"), _good()]))
    report = validate(str(path), tokenizer, SEQ, skip_bad_samples=True)
    assert report.bad == [f"{path} record 2: image {folder / 'missing.png'} does not exist"]
    assert len(validate(str(path), tokenizer, SEQ, max_samples=1).samples) == 1
    path.write_text('[\n{"messages": []},\n{oops}\n]')
    with pytest.raises(DataError, match="malformed JSON at line 3"):
        validate(str(path), tokenizer, SEQ)


def test_skipped_samples_never_reach_a_batch(folder, byte_setup):
    tokenizer, config = byte_setup
    batches = build(_jsonl(folder), tokenizer, config, SEQ, micro_batch_size=2, global_batch_size=2,
                    skip_bad_samples=True)
    assert batches.report.skipped == len(BAD_LINES)
    for _ in range(3):
        assert sorted(next(batches)["sample_index"].tolist()) == [0, 1]
