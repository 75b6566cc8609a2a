"""The harness's baseline cache: one unpatched run per configuration, keyed by everything that decides its numbers."""

import torch

from mm_adaptor.harness import runner as train
from mm_adaptor.harness import baseline


def _args(*extra):
    return train.parse_args(["--train-iters", "2", *extra])


def test_key_follows_what_changes_the_numbers_only():
    assert baseline.key(_args()) == baseline.key(_args("--timeout", "5", "--quiet", "--log-interval", "3"))
    assert baseline.key(_args()) != baseline.key(_args("--hidden-size", "32"))
    assert baseline.key(_args()) != baseline.key(_args("--bf16"))


def test_key_follows_the_adaptor_environment(monkeypatch):
    before = baseline.key(_args())
    monkeypatch.setenv("MM_ADAPTOR_DEVICE", "cpu")
    assert baseline.key(_args()) != before
    monkeypatch.delenv("MM_ADAPTOR_DEVICE")
    monkeypatch.setenv("MM_ADAPTOR_FEATURE_MODULES", "some_plugin")  # features are off in a baseline
    assert baseline.key(_args()) == before


def test_second_identical_run_comes_from_the_cache(tmp_path, monkeypatch):
    calls = []

    def fake_run(args, echo=False):
        calls.append(args)
        rank = train.RankDump(rank=0, losses=[1.5], grad_norms=[None], grads=[{"w": torch.ones(2)}])
        return train.Dump(ranks=[rank], args={"train_iters": args.train_iters})

    monkeypatch.setenv(baseline.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(train, "run", fake_run)
    first = baseline.cached_run(_args())
    second = baseline.cached_run(_args("--timeout", "7"))
    assert len(calls) == 1
    assert second.losses == first.losses == [1.5]
    assert torch.equal(second.ranks[0].grads[0]["w"], torch.ones(2))
    baseline.cached_run(_args("--seed", "7"))
    assert len(calls) == 2


def test_cache_can_be_switched_off(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setenv(baseline.CACHE_ENV, "off")
    monkeypatch.setattr(train, "run", lambda args, echo=False: calls.append(args) or train.Dump(ranks=[]))
    baseline.cached_run(_args())
    baseline.cached_run(_args())
    assert len(calls) == 2 and baseline.cache_dir() is None
