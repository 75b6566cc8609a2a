"""`mm-adaptor schedule`: stage orders from megatron's own schedule functions; with no communication the simulated
bubble equals the analytic one, (PP - 1) / M for 1F1B and (PP - 1) / (VPP x M) interleaved, to 1e-9; the extra
warm-up holds K more micro-batches per stage and, with transfers slower than a forward, finishes sooner; the command
prints the three schedules and writes the picture."""

import pytest
import warm_python

from mm_adaptor.cli import schedule
NO_COMMUNICATION = schedule.Costs(forward=1e-3, backward=2e-3)


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 4), (4, 2, 8), (4, 4, 16), (8, 2, 32), (3, 3, 9)])
@pytest.mark.parametrize("forward,backward", [(1e-3, 2e-3), (1e-3, 1e-3), (3e-3, 2e-3)])
def test_bubble_equals_the_analytic_one_without_communication(pp, vpp, m, forward, backward):
    costs = schedule.Costs(forward, backward)
    interleaved = schedule.simulate(pp, vpp, m, costs)
    assert interleaved.bubble == pytest.approx(schedule.analytic_bubble(pp, vpp, m), abs=1e-9)
    one_f_one_b = schedule.simulate(pp, 1, m, schedule.Costs(forward * vpp, backward * vpp))
    assert one_f_one_b.bubble == pytest.approx(schedule.analytic_bubble(pp, 1, m), abs=1e-9)


def test_stage_order_follows_megatrons_warmup_and_table():
    """PP4 VPP2 M8, rank 0: megatron warms up with 2 x 3 + 1 x 4 = 10 forwards, table order by groups of 4."""
    order = schedule.stage_order(4, 2, 8, rank=0)
    assert [op.kind for op in order[:10]] == ["F"] * 10 and order[10].kind == "F" and order[11].kind == "B"
    assert [(op.chunk, op.microbatch) for op in order[:6]] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    assert (order[11].chunk, order[11].microbatch) == (1, 0)  # the first backward: last chunk, micro-batch 0
    assert len(order) == 2 * 8 * 2
    extra = schedule.stage_order(4, 2, 8, rank=0, extra=2)
    assert [op.kind for op in extra[:13]] == ["F"] * 12 + ["F"] and extra[13].kind == "B"
    assert sorted(extra, key=str) == sorted(order, key=str)  # the same passes, in another order


@pytest.mark.parametrize("k", [1, 2, 3])
def test_extra_warmup_holds_k_more_and_is_exact_without_communication(k):
    plain = schedule.simulate(4, 2, 16, NO_COMMUNICATION)
    extra = schedule.simulate(4, 2, 16, NO_COMMUNICATION, extra=k)
    assert [e - p for e, p in zip(extra.peak_in_flight, plain.peak_in_flight)] == [k] * 4
    assert extra.step == pytest.approx(plain.step, abs=1e-12)


def test_extra_warmup_finishes_sooner_when_a_transfer_outlasts_a_forward():
    slow_link = schedule.Costs(forward=1e-3, backward=2e-3, latency=4e-3)
    plain = schedule.simulate(4, 2, 8, slow_link)
    extra = schedule.simulate(4, 2, 8, slow_link, extra=1)
    assert extra.step < plain.step
    assert plain.bubble > schedule.analytic_bubble(4, 2, 8)  # the transfers show


def test_command_prints_three_schedules_and_writes_the_picture(tmp_path):
    picture = tmp_path / "timeline.svg"
    done = warm_python.run(["-m", "mm_adaptor.cli", "schedule", "--pp", "4", "--vpp", "2", "--microbatches", "8",
                            "--svg", str(picture)])
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "ms" not in line.split("|")[1]]
    names = [row.split("|")[1].strip() for row in rows[1:]]
    assert names == ["megatron 1F1B", "megatron interleaved", "interleaved + extra warm-up 1"], done.stdout
    for row in rows[1:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[2]) == pytest.approx(float(cells[3]), abs=1e-4), row  # bubble = analytic
    text = picture.read_text()
    assert text.startswith("<svg") and text.count("<rect") > 3 * 4 * 16


def test_command_refuses_a_schedule_megatron_cannot_run():
    done = warm_python.run(["-m", "mm_adaptor.cli", "schedule", "--pp", "4", "--vpp", "2", "--microbatches", "6"])
    assert done.returncode == 2 and "multiple of --pp 4" in done.stderr
