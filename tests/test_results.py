"""RunRecord reads a step's loss and token counts in windows, not in every step: on a GPU each read is a sync point
that stops the host from queueing the next step while the device finishes this one."""

import pytest


class DeviceValue:
    """Stands in for a 0-dim tensor still on the device: reading it (float/int, what .item() does) is counted."""

    reads: list[int] = []

    def __init__(self, step: int, value: float):
        self.step, self.value = step, value

    def __float__(self) -> float:
        DeviceValue.reads.append(self.step)
        return self.value

    def __int__(self) -> int:
        return int(self.__float__())


@pytest.fixture
def record(tmp_path):
    from accelerate import Accelerator

    from shared.results import RunRecord

    accelerator = Accelerator(cpu=True)
    return RunRecord(accelerator, max_train_steps=25, warmup_steps=2, sync_every=10)


def test_losses_are_read_in_windows_not_in_every_step(record):
    DeviceValue.reads = []
    losses = [10.0 - step / 10 for step in range(1, 26)]
    for step in range(1, 10):
        record.step(step, DeviceValue(step, losses[step - 1]), samples=4, tokens=DeviceValue(step, 400))
        assert DeviceValue.reads == [], f"step {step}: read before the window closed"
    record.step(10, DeviceValue(10, losses[9]), samples=4, tokens=DeviceValue(10, 400))
    assert sorted(set(DeviceValue.reads)) == list(range(1, 11))  # the window of sync_every steps, read at once
    for step in range(11, 14):
        record.step(step, DeviceValue(step, losses[step - 1]), samples=4, tokens=DeviceValue(step, 400))
    assert max(DeviceValue.reads) == 10
    assert record.losses() == pytest.approx(losses[:13])  # the recipe logs: reading the losses reads the window
    assert sorted(set(DeviceValue.reads)) == list(range(1, 14))
    for step in range(14, 26):
        record.step(step, DeviceValue(step, losses[step - 1]), samples=4, tokens=DeviceValue(step, 400))
    assert sorted(set(DeviceValue.reads)) == list(range(1, 26))  # the last step reads everything
    assert record.losses() == pytest.approx(losses)
    # The clock: every step after the 2 warm-up steps measured, each window's time shared among its steps.
    assert len(record.step_times) == 23 and record.samples == 23 * 4 and record.tokens == 23 * 400
    assert all(seconds > 0 for seconds in record.step_times)


def test_plain_floats_still_work(record):
    """A recipe that reads its loss itself (linear_toy: .item()) passes a number: it is in the curve at once, also in
    the list the recipe took from ``record.losses()`` before the loop (it prints its last entry every step)."""
    curve = record.losses()
    for step in range(1, 26):
        record.step(step, 1.0 / step, samples=2, tokens=20)
        assert curve[-1] == 1.0 / step and len(curve) == step
    assert record.losses() == pytest.approx([1.0 / step for step in range(1, 26)])
    assert record.tokens == 23 * 20
