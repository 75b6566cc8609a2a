"""`mm-adaptor check --layout single`: the one-rank layout a one-GPU machine uses, exercised on the CPU
backend with every fused feature at once (the path `check` takes on a node with one GPU)."""

import warm_python

FUSED = ["--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb", "--use-flash-attn"]


def test_single_rank_check_runs_one_rank_and_judges_every_fused_feature():
    done = warm_python.run(["-m", "mm_adaptor.cli", "check", "--layout", "single", "--show-training", *FUSED,
                            "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope"], timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"\ncheck {' '.join(FUSED)} | layout single |" in done.stdout, done.stdout
    assert "TP1+PP1+DP1" in done.stdout, done.stdout
    assert "verdict: PASS" in done.stdout, done.stdout
