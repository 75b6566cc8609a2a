"""More than one node, on one machine: the same job at 1 node x 4 ranks and at 2 nodes x 2 ranks trains the same
losses, evaluates the same validation loss, and a checkpoint saved at 2 x 2 resumes at 1 x 4. The two nodes are two
torchrun agents (--nnodes 2 --node-rank 0/1, rendezvous on localhost), and then two `mm-adaptor train --nnodes 2`
commands (the trainer's own launcher)."""

import os
import re
import subprocess
import sys
import threading

import pytest

from mm_adaptor.ranks.launcher import free_port
from trainer_runs import QUICK, scalars, train

pytestmark = pytest.mark.distributed
pytest.importorskip("megatron.training")
pytest.importorskip("tensorboard")

# global batch 4: 2 micro-batches per data-parallel rank (the 4 runs' iterations are most of their cost)
JOB = [*QUICK[:-2], "--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--train-iters", "6",
       "--global-batch-size", "4", "--eval-iters", "1", "--eval-interval", "3"]
VALIDATION = re.compile(r"validation loss at iteration (\d+) \| lm loss value: (\S+) \|")
ENV = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}, "MM_ADAPTOR_DEVICE": "cpu",
       "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _torchrun_agent(node: int, port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
            "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
            "-m", "mm_adaptor.train", *args]


def _validation(out: str) -> dict[int, str]:
    return {int(i): value for i, value in VALIDATION.findall(out)}


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    tb = tmp_path_factory.mktemp("one-node")
    run = train(["--nproc-per-node", "4", *JOB, "--tensorboard-dir", str(tb)])
    assert run.status == 0, run.err[-3000:]
    return scalars(tb), _validation(run.out)


def test_two_torchrun_agents_train_as_one_node_and_their_save_resumes_there(tmp_path, one_node):
    losses, validation = one_node
    port = free_port()
    save = ["--save", str(tmp_path / "ckpt"), "--save-interval", "3", "--exit-interval", "3"]
    agents = [subprocess.Popen(_torchrun_agent(node, port, *JOB, *save, "--tensorboard-dir", str(tmp_path / "two")),
                               env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for node in (0, 1)]
    outputs = [agent.communicate(timeout=600) for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], [err[-2000:] for _, err in outputs]
    two_nodes = scalars(tmp_path / "two")
    assert two_nodes == {step: losses[step] for step in (1, 2, 3)}
    assert _validation(outputs[0][0] + outputs[1][0]) == {3: validation[3]}  # on the job's last rank
    resumed = train(["--nproc-per-node", "4", *JOB, "--load", str(tmp_path / "ckpt"),
                     "--tensorboard-dir", str(tmp_path / "resumed")])
    assert resumed.status == 0, resumed.err[-3000:]
    assert {**two_nodes, **scalars(tmp_path / "resumed")} == losses
    assert _validation(resumed.out) == {6: validation[6]}


def test_two_trainer_commands_with_nnodes_train_as_one_node(tmp_path, one_node):
    """Node 1 in another process, node 0 in this one (the trainer's launcher, rendezvous on node 0's port)."""
    losses, _ = one_node
    port = free_port()
    nodes = ["--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
             "--tensorboard-dir", str(tmp_path)]
    other = subprocess.Popen([sys.executable, "-m", "mm_adaptor.cli", "train", *JOB, *nodes, "--node-rank", "1"],
                             env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done = {}
    threading.Thread(target=lambda: done.update(out=other.communicate(timeout=600)), daemon=True).start()
    run = train([*JOB, *nodes, "--node-rank", "0"])
    other.wait(timeout=600)
    assert run.status == 0 and other.returncode == 0, (run.err[-2000:], other.returncode)
    assert scalars(tmp_path) == losses  # written by the job's last rank, on node 1
