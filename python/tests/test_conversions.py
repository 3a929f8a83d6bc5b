"""The conversions between the coordinator's model layout and what a
PyTorch or NumPy training function holds: names, shapes, dtypes and
layouts, and the clear errors for what does not fit."""

import numpy as np
import pytest

import cohort
from cohort.flower import from_numpy_client

LAYOUT = [("fc.weight", (3, 4)), ("fc.bias", (3,))]


def model(round_number=1):
    return cohort.Model(np.arange(15, dtype=np.float32), LAYOUT, cohort.Round(round_number, 0))


def test_the_model_is_named_tensors_viewing_one_flat_array():
    m = model()
    assert m.names == ["fc.weight", "fc.bias"]
    assert len(m) == 15
    tensors = m.numpy()
    assert list(tensors) == ["fc.weight", "fc.bias"]
    assert tensors["fc.weight"].shape == (3, 4)
    assert tensors["fc.bias"].tolist() == [12.0, 13.0, 14.0]
    # Views, not copies.
    assert np.shares_memory(tensors["fc.weight"], m.flat)
    assert np.shares_memory(tensors["fc.bias"], m.flat)


def test_a_model_whose_layout_does_not_add_up_is_refused():
    with pytest.raises(cohort.InvalidArgumentError, match="14 values"):
        cohort.Model(np.zeros(15, np.float32), [("w", (2, 7))])
    with pytest.raises(cohort.InvalidArgumentError, match="float32"):
        cohort.Model(np.zeros(15, np.float64), LAYOUT)


def test_an_update_is_read_in_the_layouts_order_whatever_its_form():
    weight = np.ones((3, 4), np.float32)
    bias = np.full(3, 2.0, np.float32)
    for weights in (
        {"fc.bias": bias, "fc.weight": weight},  # a dict in another order
        [weight, bias],  # a list in the layout's order
        {"fc.weight": weight.astype(np.float64), "fc.bias": bias.astype(np.float16)},  # other dtypes
        {"fc.weight": weight, "fc.bias": bias, "extra.num_batches_tracked": np.array(7)},  # not sent
    ):
        tensors = cohort.Update(weights, examples=5).tensors(LAYOUT)
        assert [t.dtype for t in tensors] == [np.float32, np.float32]
        assert all(t.flags["C_CONTIGUOUS"] for t in tensors)
        np.testing.assert_array_equal(tensors[0], weight)
        np.testing.assert_array_equal(tensors[1], bias)


def test_a_contiguous_float32_tensor_is_not_copied():
    weight = np.ones((3, 4), np.float32)
    tensors = cohort.Update({"fc.weight": weight, "fc.bias": np.zeros(3, np.float32)}, 1).tensors(LAYOUT)
    assert tensors[0] is weight or np.shares_memory(tensors[0], weight)
    # A transposed view is made contiguous (one copy), in the right order.
    transposed = np.arange(12, dtype=np.float32).reshape(4, 3).T
    tensors = cohort.Update([transposed, np.zeros(3, np.float32)], 1).tensors(LAYOUT)
    assert tensors[0].flags["C_CONTIGUOUS"]
    np.testing.assert_array_equal(tensors[0], transposed)


def test_updates_that_do_not_fit_say_what_is_wrong():
    weight, bias = np.ones((3, 4), np.float32), np.ones(3, np.float32)
    with pytest.raises(cohort.InvalidUpdateError, match="no tensor fc.bias"):
        cohort.Update({"fc.weight": weight, "head.bias": bias}, 1).tensors(LAYOUT)
    with pytest.raises(cohort.InvalidUpdateError, match=r"fc.weight has shape \(4, 3\)"):
        cohort.Update({"fc.weight": weight.T, "fc.bias": bias}, 1).tensors(LAYOUT)
    with pytest.raises(cohort.InvalidUpdateError, match="1 tensors for a model of 2"):
        cohort.Update([weight], 1).tensors(LAYOUT)
    with pytest.raises(cohort.InvalidUpdateError, match="not real numbers"):
        cohort.Update([np.array([["a"] * 4] * 3), bias], 1).tensors(LAYOUT)
    for examples in (0, -1, 2**32, 1.5, True, "3"):
        with pytest.raises(cohort.InvalidUpdateError, match="examples"):
            cohort.Update([weight, bias], examples)
    with pytest.raises(cohort.InvalidUpdateError, match="unknown metric 'f1'"):
        cohort.Update([weight, bias], 1, metrics={"f1": 0.5})
    # InvalidUpdateError is also a ValueError.
    with pytest.raises(ValueError):
        cohort.Update([weight, bias], -1)


def test_scalars_stay_scalars_and_complex_numbers_are_refused():
    layout = [("scale", ()), ("w", (2,))]
    tensors = cohort.Update({"scale": np.float64(2.5), "w": [1, 2]}, 1).tensors(layout)
    assert tensors[0].shape == () and tensors[0] == 2.5
    assert tensors[1].dtype == np.float32
    with pytest.raises(cohort.InvalidUpdateError, match="not real numbers"):
        cohort.Update({"scale": 1j, "w": [1, 2]}, 1).tensors(layout)


def test_a_fortran_ordered_array_is_sent_in_c_order():
    fortran = np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4))
    tensors = cohort.Update([fortran, np.zeros(3, np.float32)], 1).tensors(LAYOUT)
    assert tensors[0].flags["C_CONTIGUOUS"]
    np.testing.assert_array_equal(tensors[0].reshape(-1), np.arange(12, dtype=np.float32))


def test_metrics_take_their_names_and_flowers_aliases():
    update = cohort.Update([], 1, metrics={"loss": 0.25, "accuracy": 0.5, "eval_loss": 1})
    assert update.metrics == {"train_loss": 0.25, "train_accuracy": 0.5, "eval_loss": 1.0}
    with pytest.raises(cohort.InvalidUpdateError, match="given twice"):
        cohort.Update([], 1, metrics={"loss": 0.25, "train_loss": 0.5})


torch = pytest.importorskip("torch")


def test_pytorch_tensors_cross_without_copies_and_back():
    m = model()
    state = m.torch()
    assert list(state) == ["fc.weight", "fc.bias"]
    assert state["fc.weight"].shape == torch.Size([3, 4])
    assert state["fc.weight"].data_ptr() == m.flat.ctypes.data
    net = torch.nn.Module()
    net.fc = torch.nn.Linear(4, 3)
    net.load_state_dict(state)
    with torch.no_grad():
        net.fc.weight += 1
    tensors = cohort.Update(net.state_dict(), examples=2).tensors(m.layout)
    np.testing.assert_array_equal(tensors[0], np.arange(12, dtype=np.float32).reshape(3, 4) + 1)
    # A float32 CPU tensor's array shares its memory.
    assert tensors[0].ctypes.data == net.fc.weight.data_ptr()
    # Other dtypes are converted; gradients do not matter.
    half = {"fc.weight": net.fc.weight.to(torch.bfloat16), "fc.bias": net.fc.bias * 1}
    tensors = cohort.Update(half, examples=2).tensors(m.layout)
    assert tensors[0].dtype == np.float32 and tensors[1].dtype == np.float32


class FlowerStyle:
    """A NumPyClient as Flower's examples write one."""

    def __init__(self, shapes):
        self.shapes = shapes
        self.seen = []

    def get_parameters(self, config):
        return [np.zeros(s, np.float32) for s in self.shapes]

    def fit(self, parameters, config):
        self.seen.append((len(parameters), config["server_round"], config.get("lr")))
        return [p + 1 for p in parameters], 7, {"loss": 0.5, "f1": 0.9, "note": "text", "accuracy": 87.5}


def test_a_numpy_client_runs_as_a_training_function(caplog):
    numpy_client = FlowerStyle([(3, 4), (3,)])
    train = from_numpy_client(numpy_client, config={"lr": 0.1})
    m = model(round_number=4)
    update = train(m, m.round)
    assert numpy_client.seen == [(2, 4, 0.1)]
    assert update.examples == 7
    # Only what secure aggregation can count is sent, with a warning for the rest.
    assert update.metrics == {"train_loss": 0.5}
    assert "'f1'" in caplog.text and "'note'" in caplog.text
    # An accuracy in per cent is outside the core's range: dropped, not the round.
    assert "'accuracy' is not sent: 87.5 is outside [0, 1]" in caplog.text
    tensors = update.tensors(m.layout)
    np.testing.assert_array_equal(tensors[1], [13.0, 14.0, 15.0])


def test_a_numpy_client_of_another_model_is_refused_before_it_trains():
    numpy_client = FlowerStyle([(4, 3), (3,)])
    train = from_numpy_client(numpy_client)
    m = model()
    with pytest.raises(cohort.InvalidUpdateError, match=r"shapes \[\(4, 3\), \(3,\)\]"):
        train(m, m.round)
    assert numpy_client.seen == []
    with pytest.raises(TypeError, match="no get_parameters method"):
        from_numpy_client(object())
