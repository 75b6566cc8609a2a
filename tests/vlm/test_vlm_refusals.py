"""The VLM branch refuses, before any rank starts, in one line each: a bad data set (mm_adaptor.data's
validation), layouts the model cannot take, and flags that need others."""

import json

import pytest

from mm_adaptor.harness.runner import LayoutError, check_args, parse_args


def _problems(*argv, nproc=2):
    args = parse_args(["--model", "qwen2_5_vl-tiny", "--nproc-per-node", str(nproc), *argv])
    with pytest.raises(LayoutError) as error:
        check_args(args, nproc, check_devices=False)
    return error.value.problems


def test_a_bad_data_set_is_one_line_and_exit_status_2(tmp_path):
    pytest.importorskip("PIL")
    pytest.importorskip("megatron.training")
    from trainer_runs import train

    data = tmp_path / "bad.json"
    data.write_text(json.dumps([{"messages": [{"role": "user", "content": "<image>hi"},
                                              {"role": "assistant", "content": "yes"}],
                                 "images": ["missing.png"]}]))
    run = train(["--model", "qwen2_5_vl-tiny", "--data-path", str(data)])
    assert run.status == 2, run.err
    err = run.err.strip().splitlines()
    assert len(err) == 1 and "missing.png does not exist" in err[0] and err[0].startswith("mm-adaptor train"), err


def _bad_and_good_records(tmp_path):
    from PIL import Image

    Image.new("RGB", (28, 28), "red").save(tmp_path / "red.png")
    good = {"messages": [{"role": "user", "content": "<image>hi"}, {"role": "assistant", "content": "yes"}],
            "images": ["red.png"]}
    llava = {"conversations": [{"from": "human", "value": "<image>hi"}, {"from": "gpt", "value": "yes"}],
             "image": "red.png"}
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in (good, llava)) + "\n")
    return data


def test_a_bad_sample_names_the_flag_that_skips_it_and_llava_records_the_converter(tmp_path):
    pytest.importorskip("PIL")
    data = _bad_and_good_records(tmp_path)
    problems = _problems("--data-path", str(data), "--seq-length", "256", nproc=1)
    assert len(problems) == 1, problems
    assert "1 bad samples (--skip-bad-samples trains on the rest)" in problems[0], problems
    assert "LLaVA's \"conversations\" form; `mm-adaptor data llava-to-messages IN OUT` converts it" in problems[0]
    check_args(parse_args(["--model", "qwen2_5_vl-tiny", "--nproc-per-node", "1", "--data-path", str(data),
                           "--seq-length", "256", "--skip-bad-samples"]), 1, check_devices=False)


@pytest.mark.parametrize("argv, message", [
    (["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1"],
     "virtual pipeline stages are not supported"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-layers", "1,2"], "--pipeline-layers 1,2: give 2 stages"),
    (["--freeze-language"], "--freeze-language trains the vision encoder and projector only"),
    (["--pipeline-model-parallel-size", "2", "--freeze-vision", "--freeze-language"], "leaves later stages"),
])
def test_layout_refusals(argv, message):
    problems = _problems(*argv)
    assert len(problems) == 1 and message in problems[0], problems


def test_qwen2_5_vl_needs_a_converted_checkpoint():
    problems = _problems("--model", "qwen2_5_vl")
    assert problems == ["--model qwen2_5_vl needs --load MCORE_DIR (written by mm-adaptor convert hf-to-mcore)"]


def test_an_uneven_pipeline_split_is_accepted():
    args = parse_args(["--model", "qwen2_5_vl-tiny", "--pipeline-model-parallel-size", "2", "--pipeline-layers", "1,3"])
    check_args(args, 2, check_devices=False)
