"""The device-generic snapshot copy (replica/devicecopy.py). On the CPU (this suite) the same code runs with torch's
CPU stream: the copy is complete when issued and "written" is said at once on the caller's thread. The helper
thread's ordering is tested with events that complete when told to (pure logic); the CUDA test is skipped here."""
import threading
import time

import pytest
import torch

from deadpool_hpc.replica.devicecopy import DeviceCopier
from deadpool_hpc.replica.snapshot import Slot, StateLayout


def _state():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(64, 8, generator=g), torch.randn(1000, generator=g).to(torch.bfloat16),
            torch.arange(5, dtype=torch.int64)]


def test_cpu_copy_is_complete_when_issued_and_written_is_said_at_once_on_the_callers_thread():
    tensors, rng = _state(), torch.get_rng_state()
    layout = StateLayout(tensors, rng.numel())
    slot = Slot(layout.nbytes)
    c = DeviceCopier("cpu")
    assert c.events is False
    done = c.copy(layout, slot, tensors, rng, 7)
    assert done is not None and done.query()
    said = []
    c.when_done(done, lambda: said.append(threading.current_thread()))
    assert said == [threading.current_thread()] and c.idle() and c._thread is None   # no helper thread on the CPU
    c.before_update()
    for want, got in zip(tensors, layout.views(slot)):
        assert torch.equal(want, got)
    assert torch.equal(slot.tensor[layout.state_nbytes:], rng) and slot.step == 7
    # the copy is a snapshot: a later update of the state leaves the slot as it was
    tensors[0].add_(1.0)
    assert not torch.equal(tensors[0], layout.views(slot)[0])


def test_a_stopped_copy_returns_none_and_leaves_the_slot_invalid():
    tensors, rng = _state(), torch.get_rng_state()
    layout = StateLayout(tensors, rng.numel())
    slot = Slot(layout.nbytes)
    assert DeviceCopier("cpu").copy(layout, slot, tensors, rng, 1, should_stop=lambda: True) is None
    assert slot.step is None


class Ev:
    """An event that completes when told to."""

    def __init__(self, done=False):
        self.done = done

    def query(self):
        return self.done


def test_written_waits_for_the_event_on_the_helper_thread_in_order():
    c = DeviceCopier("cpu")
    said, e1, e2 = [], Ev(), Ev()
    c.when_done(e1, lambda: said.append(("one", threading.current_thread().name)))
    c.when_done(e2, lambda: said.append(("two", threading.current_thread().name)))
    e2.done = True
    time.sleep(0.05)
    assert said == [] and not c.idle()   # in order: two waits for one
    e1.done = True
    end = time.monotonic() + 5
    while len(said) < 2 and time.monotonic() < end:
        time.sleep(0.005)
    assert said == [("one", "deadpool-copy-events"), ("two", "deadpool-copy-events")] and c.idle()
    c.close()


def test_a_quiesce_drops_the_written_not_yet_said():
    c = DeviceCopier("cpu")
    said, ev = [], Ev()
    c.when_done(ev, lambda: said.append(1))
    c.drop_pending()
    ev.done = True
    time.sleep(0.05)
    assert said == [] and c.idle()
    c.close()


def test_complete_polls_until_done_or_stopped():
    assert DeviceCopier.complete(None) and DeviceCopier.complete(Ev(True))
    t0 = time.monotonic()
    assert DeviceCopier.complete(Ev(), timeout=0.05) is False and time.monotonic() - t0 >= 0.05
    assert DeviceCopier.complete(Ev(), stop=lambda: True) is False
    ev = Ev()
    threading.Timer(0.03, lambda: setattr(ev, "done", True)).start()
    assert DeviceCopier.complete(ev, timeout=5) is True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_side_stream_copy_orders_after_the_step_and_before_the_next_update():
    dev = torch.device("cuda", 0)
    tensors = [t.to(dev) for t in _state()]
    rng = torch.get_rng_state()
    layout = StateLayout(tensors, rng.numel())
    slot = Slot(layout.nbytes)   # pinned where CUDA is available
    c = DeviceCopier(dev)
    tensors[0].mul_(3.0)   # "the optimizer step": the copy must see it
    want = [t.cpu() for t in tensors]
    done = c.copy(layout, slot, tensors, rng, 2)
    c.before_update()
    tensors[0].add_(1.0)   # "the next update": ordered after the copy on the device
    written = threading.Event()
    c.when_done(done, written.set)
    assert written.wait(10)
    for w, got in zip(want, layout.views(slot)):
        assert torch.equal(w, got)
    c.close()
