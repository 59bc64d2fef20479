"""The decisions behind CUDA-graph capture, on any machine (tests/test_func_graphs.py captures on the GPU): a table
copied from the host while capturing is refused at the one place tables go up, a route that cannot be captured
refuses by name, and the step and lr must be tensors on the params' device. Capture is simulated by patching
torch's "is the current stream capturing" query."""

from __future__ import annotations

import importlib

import pytest
import torch

from bnbf import ops
from bnbf._bounded import Bounded
from bnbf.kernels import launcher
from bnbf.rules import get_rule

plan = importlib.import_module("bnbf.plan")  # the module (bnbf.plan is also the function)
CUDA = torch.device("cuda")


@pytest.fixture
def capturing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)


def test_a_table_copied_from_the_host_is_refused_while_capturing(capturing):
    with pytest.raises(RuntimeError, match="would be copied from the host while capturing.*warm up"):
        launcher._to_device(torch.zeros(3, dtype=torch.int64), CUDA)
    t = torch.zeros(3, dtype=torch.int64)
    assert launcher._to_device(t, torch.device("cpu")) is t  # CPU tables are used where they are


def test_routes_refuse_by_name_while_capturing(capturing):
    ops._refuse_capture(CUDA, None)  # an in-place step: its tables decide (above)
    with pytest.raises(RuntimeError, match="pure update writes new outputs"):
        ops._refuse_capture(CUDA)
    with pytest.raises(RuntimeError, match="packed state's step is not capturable"):
        ops._refuse_capture(CUDA, ops.PACKED_NOT_CAPTURABLE)
    with pytest.raises(RuntimeError, match="bnbf::step_ op"):
        ops._refuse_capture(CUDA, ops.OP_NOT_CAPTURABLE)
    with pytest.raises(RuntimeError, match="stepped on the host"):  # CPU tensors, whatever the route
        ops._refuse_capture(torch.device("cpu"), None)


def test_a_host_row_of_numbers_is_refused_while_capturing(capturing):
    """A compiled step whose scalars are all numbers gives the op a float64 row on the host (bnbf.plan._one_set),
    read as kernel arguments: a captured graph would replay them, so a capture refuses it; a float32 row (tensor
    hyperparameters, on the device) goes on as it is."""
    host = torch.tensor([1e-3, 0.9], dtype=torch.float64)
    with pytest.raises(RuntimeError, match="0-d tensors on the params' device to capture a compiled step"):
        ops.host_numbers(host, CUDA)
    row = torch.tensor([1e-3, 0.9])
    assert ops.host_numbers(row, CUDA) is row


def test_no_refusal_outside_a_capture(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    ops._refuse_capture(CUDA)
    ops._refuse_capture(torch.device("cpu"), ops.OP_NOT_CAPTURABLE)


def test_the_step_and_lr_must_be_tensors_on_the_params_device():
    rule = get_rule("adamw")
    meta = torch.device("meta")  # a device with tensors on any machine, standing for the params'
    on = lambda v: torch.tensor(v, device=meta)  # noqa: E731
    plan.check_capture_scalars(rule.make_hparams({"lr": on(1e-3)}), on(3), meta)
    cases = [
        ({"lr": on(1e-3)}, 3, "step must be a 0-d tensor on meta.*got int"),
        ({"lr": 1e-3}, on(3), "lr must be a 0-d tensor on meta.*got float"),
        ({"lr": torch.tensor(1e-3)}, on(3), "lr must be a 0-d tensor on meta.*another device.*on cpu"),
        ({"lr": on(1e-3), "weight_decay": torch.tensor(0.1)}, on(3), "weight_decay is on cpu, the params on meta"),
    ]
    for hp, step, match in cases:
        with pytest.raises(RuntimeError, match=match):
            plan.check_capture_scalars(rule.make_hparams(hp), step, meta)


def test_the_numbers_beside_tensor_scalars_go_up_once_and_are_held_for_a_capture(monkeypatch):
    monkeypatch.setattr(plan, "_NUMBER_ROWS", Bounded(plan._NUMBER_ROWS.size))
    monkeypatch.setattr(plan, "_HELD_NUMBER_ROWS", {})
    cpu = torch.device("cpu")
    values = (0.9, torch.tensor(2.5), -0.0, 3, torch.tensor(7, dtype=torch.int64))
    assert plan._number_row(values, cpu, capturing=True) is None  # not made before the capture: the fills' route
    made = plan._number_row(values, cpu, capturing=False)
    assert torch.equal(torch.stack(made), torch.tensor([0.9, 0.0, -0.0, 3.0, 0.0])) and torch.signbit(made[2])
    assert plan._number_row(values, cpu, capturing=False) is made and not plan._HELD_NUMBER_ROWS
    assert plan._number_row(values, cpu, capturing=True) is made  # read by a capture: held for good
    assert len(plan._HELD_NUMBER_ROWS) == 1
    zero = (0.9, torch.tensor(2.5), 0.0, 3, torch.tensor(7))  # +0.0 for -0.0: other bits, another row
    assert not torch.signbit(plan._number_row(zero, cpu, capturing=False)[2])
    moved = (0.9, 2.5, -0.0, torch.tensor(3.0), torch.tensor(7))  # the same numbers where other tensors stand
    assert plan._number_row(moved, cpu, capturing=False) is not made
    for k in range(plan._NUMBER_ROWS.size + 4):  # bounded
        plan._number_row((float(k), torch.tensor(1.0)), cpu, capturing=False)
    assert len(plan._NUMBER_ROWS) == plan._NUMBER_ROWS.size


def test_a_scalar_row_is_the_values_rounded_to_float32_in_order():
    values = (0.1, torch.tensor(1e-3, dtype=torch.float64), -0.0, 3, torch.tensor(7), torch.tensor(2.5))
    want = torch.tensor([0.1, 1e-3, -0.0, 3.0, 7.0, 2.5], dtype=torch.float64).to(torch.float32)
    for _ in range(2):  # made, then from the cached numbers
        row = plan.scalar_row(values, torch.device("cpu"))
        assert row.dtype == torch.float32 and torch.equal(row.view(torch.int32), want.view(torch.int32))


def test_each_stream_has_its_number_rows_and_a_capture_takes_any_made_before_it(monkeypatch):
    monkeypatch.setattr(plan, "_NUMBER_ROWS", Bounded(plan._NUMBER_ROWS.size))
    monkeypatch.setattr(plan, "_HELD_NUMBER_ROWS", {})
    cpu = torch.device("cpu")
    values = (0.9, torch.tensor(2.5))
    monkeypatch.setattr(plan, "_stream_of", lambda device: 1)
    on_one = plan._number_row(values, cpu, capturing=False)
    monkeypatch.setattr(plan, "_stream_of", lambda device: 2)
    on_two = plan._number_row(values, cpu, capturing=False)
    # another stream uploads its own (reading stream 1's could precede its copy, or follow its memory's reuse)
    assert on_two is not on_one and len(plan._NUMBER_ROWS) == 2
    monkeypatch.setattr(plan, "_stream_of", lambda device: 3)  # a capture's own stream: a row made before it
    assert plan._number_row(values, cpu, capturing=True) is on_two
    monkeypatch.setattr(plan, "_NUMBER_ROWS", Bounded(plan._NUMBER_ROWS.size))  # evicted: the graph's row is still held
    assert [e[1] for e in plan._HELD_NUMBER_ROWS.values()] == [on_two]


def test_rows_made_under_fake_tensor_mode_and_outside_it_never_mix(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    monkeypatch.setattr(plan, "_NUMBER_ROWS", Bounded(plan._NUMBER_ROWS.size))
    cpu = torch.device("cpu")
    with FakeTensorMode():
        fake = plan.scalar_row((0.9, torch.tensor(2.5)), cpu)
    real = plan.scalar_row((0.9, torch.tensor(2.5)), cpu)
    with FakeTensorMode() as mode:
        again = plan.scalar_row((0.9, mode.from_tensor(torch.tensor(2.5))), cpu)
    assert isinstance(fake, FakeTensor) and isinstance(again, FakeTensor) and type(real) is torch.Tensor
    assert torch.equal(real, torch.tensor([0.9, 2.5]))
