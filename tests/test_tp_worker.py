"""Tensor parallelism's messages (minfer/engine/tp_worker.py): one pickle per call, counted as sent; only the
worker's methods can be called; a call runs the method it names. In one process (the workers' own runs are
tests/test_tensor_parallel.py's)."""
import pickle

import pytest
import torch
import torch.distributed as dist

from minfer.engine import tp_worker
from minfer.engine.parallel import free_port
from minfer.engine.tp_worker import WORKER_METHODS, Call, Channel, PoolSpec, StepInputs, Worker
from minfer.layers.parallel_linear import CommStats
from minfer.lab.testing import tiny_llama


@pytest.fixture
def sent(monkeypatch) -> list[bytes]:
    """What the channel broadcasts, recorded instead of sent."""
    payloads = []
    monkeypatch.setattr(tp_worker, "broadcast_payload", lambda payload, device: payloads.append(payload) or payload)
    return payloads


def test_counted_bytes_are_the_one_pickle_sent(sent, monkeypatch):
    pickles = []
    dumps = pickle.dumps
    monkeypatch.setattr(pickle, "dumps", lambda obj, *a, **k: pickles.append(dumps(obj, *a, **k)) or pickles[-1])
    stats = CommStats()
    channel = Channel(torch.device("cpu"), stats)
    step = StepInputs(list(range(40)), list(range(40)), 37, [], False)
    channel.call("step", step)
    channel.call("make_pool", PoolSpec(48, 8, "auto", True))
    assert pickles == sent  # each call pickled once, and that pickle is what went out
    assert stats.broadcasts == 2 and stats.broadcast_bytes == len(sent[0]) + len(sent[1])
    assert pickle.loads(sent[0]) == Call("step", (step,))


def test_an_unknown_method_is_refused_before_anything_is_sent(sent):
    stats = CommStats()
    with pytest.raises(ValueError, match=r"unknown worker method 'reboot': a tensor-parallel worker runs one of "
                                         r"\('make_pool', 'profile', 'step', 'stop'\)"):
        Channel(torch.device("cpu"), stats).call("reboot")
    assert sent == [] and stats.broadcasts == 0 and stats.broadcast_bytes == 0


def test_the_worker_refuses_an_unknown_method_that_arrives():
    model = tiny_llama()
    worker = Worker(model, model.config, torch.float32, torch.device("cpu"))
    forged = object.__new__(Call)  # as unpickling makes it: no __post_init__ check
    object.__setattr__(forged, "method", "__init__")
    object.__setattr__(forged, "args", ())
    with pytest.raises(ValueError, match=r"unknown worker method '__init__'"):
        worker.run(forged)
    assert set(WORKER_METHODS) <= set(dir(Worker))  # every callable name is a method of the worker


def test_a_call_runs_the_method_it_names(sent):
    model = tiny_llama()
    worker = Worker(model, model.config, torch.float32, torch.device("cpu"))
    channel = Channel(torch.device("cpu"), CommStats())
    channel.call("make_pool", PoolSpec(6, 4, "auto", True))
    channel.call("stop")
    for payload in sent:
        worker.run(pickle.loads(payload))
    assert worker.pool.num_blocks == 6 and worker.bucket_widths is True and not worker.running


def test_broadcast_payload_through_a_process_group():
    """The bytes travel as a length, then the bytes (a group of one: rank 0 gets back what it sent)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        payload = pickle.dumps(Call("stop"))
        assert tp_worker.broadcast_payload(payload, torch.device("cpu")) == payload
    finally:
        dist.destroy_process_group()
