"""`jetrl.rollout.transfer`: a payload packed into parcels comes back byte for byte, in this process and opened in
a spawned one (on a CPU the parcels carry their buffers by value, on a GPU CUDA IPC handles), groups stay
together, a parcel stays under its size, and bad grouping is named."""

import multiprocessing
import os
import pickle
import queue

import pytest
import torch

from jetrl.rollout.transfer import Parcel, pack_buckets


def _payload():
    g = torch.Generator().manual_seed(0)
    fp8 = torch.randn(256, 384, generator=g).to(torch.float8_e4m3fn)
    return {
        "a.q_proj.weight": (fp8, torch.rand(2, 3, generator=g)),
        "a.k_proj.weight": (fp8[:128].clone(), torch.rand(1, 3, generator=g)),
        "a.norm.weight": torch.randn(384, generator=g).to(torch.bfloat16),
        "embed.weight": torch.randn(77, 384, generator=g).to(torch.bfloat16),  # odd byte count: 77 * 768
        "scalar": torch.tensor(3.5),
    }


def _same(a, b) -> bool:
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


@pytest.mark.parametrize("bucket_bytes", [1, 100_000, 1 << 30])
def test_parcels_bring_back_every_byte_and_keep_groups_together(bucket_bytes):
    payload = _payload()
    groups = [["a.q_proj.weight", "a.k_proj.weight"], ["a.norm.weight"], ["embed.weight"], ["scalar"]]
    got, parcels = {}, []
    for names, parcel in pack_buckets(payload, groups, bucket_bytes):
        parcel = pickle.loads(pickle.dumps(parcel))  # as it travels to a worker process
        opened = parcel.open()
        assert sorted(opened) == sorted(names)
        got.update(opened)
        parcels.append(names)
    assert sorted(got) == sorted(payload) and all(_same(payload[k], got[k]) for k in payload)
    for group in groups:  # each group in one parcel
        assert sum(all(n in names for n in group) for names in parcels) == 1
    if bucket_bytes == 1:
        assert len(parcels) == len(groups)  # every group alone (each larger than the bucket)
    if bucket_bytes == 1 << 30:
        assert len(parcels) == 1


def test_a_parcel_stays_under_its_size_unless_one_group_is_larger():
    payload = {f"t{i}": torch.zeros(1000, dtype=torch.uint8) for i in range(10)}  # 1024 bytes each, aligned
    sizes = [p.nbytes for _, p in pack_buckets(payload, [[k] for k in payload], 3000)]
    assert sizes == [2048] * 5


@pytest.mark.parametrize(
    ("groups", "named"),
    [
        ([["x"]], r"missing \['y'\]"),
        ([["x", "y", "z"]], r"unknown \['z'\]"),
        ([["x", "y"], ["y"]], r"repeated \['y'\]"),
    ],
)
def test_bad_groups_are_named(groups, named):
    payload = {"x": torch.zeros(4), "y": torch.zeros(4)}
    with pytest.raises(ValueError, match=named):
        list(pack_buckets(payload, groups))


def test_bad_sizes_and_empty_parcels_are_refused():
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        list(pack_buckets({"x": torch.zeros(4)}, [["x"]], 0))
    with pytest.raises(ValueError, match="neither"):
        Parcel([], 0).open()
    with pytest.raises(ValueError, match="the index says 8"):
        Parcel([("x", -1, "uint8", (8,), 0, 8)], 8, data=torch.zeros(4, dtype=torch.uint8)).open()


def _plain(t: torch.Tensor) -> tuple:
    """dtype, shape and bytes: what the child sends back (a tensor put on a queue would travel as a shared-memory
    file descriptor that dies with the child)."""
    return str(t.dtype), tuple(t.shape), t.cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def _receive(parcel, results) -> None:
    """In a child process: open the parcel (on a GPU mapping the sender's memory) and send back its bytes."""
    opened = parcel.open()
    results.put({k: tuple(map(_plain, v)) if isinstance(v, tuple) else _plain(v) for k, v in opened.items()})


def _wait_for(results, child):
    """The child's answer; a child that died without one fails the test instead of blocking it forever."""
    while True:
        alive = child.is_alive()  # read before waiting: a child that had exited had flushed what it sent
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            if not alive:
                raise AssertionError(f"the child exited (code {child.exitcode}) without answering") from None


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA IPC handles)")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, _CUDA])])
def test_parcels_open_in_another_process(device):
    """A parcel opened in a spawned process gives exactly the payload: on a GPU it carries an IPC handle, not the
    bytes (the child maps the sender's buffer), on a CPU the buffer itself."""
    payload = {
        k: tuple(t.to(device) for t in v) if isinstance(v, tuple) else v.to(device) for k, v in _payload().items()
    }
    ctx, on_gpu = multiprocessing.get_context("spawn"), device == "cuda"
    for names, parcel in pack_buckets(payload, [[k] for k in payload], 100_000 if on_gpu else 1 << 30):
        assert (parcel.handle is not None, parcel.data is not None) == (on_gpu, not on_gpu)
        results = ctx.Queue()
        child = ctx.Process(target=_receive, args=(parcel, results))
        child.start()
        got = _wait_for(results, child)
        child.join()
        assert child.exitcode == 0 and sorted(got) == sorted(names)
        for k in names:
            want = tuple(map(_plain, payload[k])) if isinstance(payload[k], tuple) else _plain(payload[k])
            assert got[k] == want, k


def test_a_child_that_dies_without_answering_fails_the_wait():
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=os._exit, args=(3,))
    child.start()
    with pytest.raises(AssertionError, match=r"exited \(code 3\) without answering"):
        _wait_for(ctx.Queue(), child)
