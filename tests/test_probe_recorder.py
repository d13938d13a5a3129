"""Per-layer times from hook timestamps, and expanding layer schedules to parameter buckets."""

import pytest

from lightning_pipedap.probe.recorder import StepRecorder, group_layers, merge_steps
from lightning_pipedap.schedule import builtin_schedule, expand_layers


def _recorded(times):
    ts = iter(times)
    r = StepRecorder([0, 0, 1, 2], 3, clock=lambda: next(ts))
    r.forward_start()          # 0
    r.layer_used(0)            # 1
    r.layer_used(1)            # 3
    r.layer_used(0)            # (second call of layer 0's module: ignored, clock not read)
    r.layer_used(2)            # 6
    r.forward_end()            # 10
    r.backward_start()         # 11
    r.param_ready(3)           # 12.5 -> layer 2
    r.param_ready(2)           # 14   -> layer 1
    r.param_ready(1)           # 14.5 -> layer 0 (first of its two params)
    r.param_ready(0)           # 15   -> layer 0 complete
    r.backward_end()           # 16
    return r


def test_step_recorder_segments_add_up():
    r = _recorded([0.0, 1.0, 3.0, 6.0, 10.0, 11.0, 12.5, 14.0, 14.5, 15.0, 16.0])
    r.pre_gap = 0.5
    t_f, t_b = r.times()
    # layer 0 also gets the 1 s before its first use and the 0.5 s gap before the step;
    # the last layer gets the 1 s between forward end and backward start
    assert t_f == [3.5, 3.0, 5.0]
    assert t_b == [2.0, 1.5, 1.5]  # layer 0 also gets the 1 s after its gradients were ready
    assert sum(t_f) == 11.5 and sum(t_b) == 5.0


def test_several_backward_passes_in_one_step():
    """Manual optimization: two forward segments, each followed by a backward pass inside training_step (a GAN's
    generator then discriminator step); a layer used again after a pass counts again, a module call inside a
    pass (recomputation) does not, and the optimizer step after the last pass goes to the layer used last."""
    ts = iter([0.0, 1.0, 2.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 11.0, 12.0, 13.0, 16.0])
    r = StepRecorder([0, 1], 2, clock=lambda: next(ts))
    r.forward_start()          # 0
    r.layer_used(0)            # 1
    r.layer_used(1)            # 2
    r.backward_start()         # 4   (layer 1 forward 2..4)
    r.layer_used(0)            # (inside the pass: ignored, clock not read)
    r.param_ready(1)           # 5
    r.param_ready(0)           # 6
    r.backward_end()           # 7
    r.layer_used(1)            # 8   (second segment: the 1 s after the pass goes to the first layer used then)
    r.layer_used(0)            # 9
    r.backward_start()         # 11
    r.param_ready(0)           # 12  (layer 1 got no gradient in this pass)
    r.backward_end()           # 13
    assert r.complete is False  # (training_step has not returned)
    r.forward_end()            # 16  (the last optimizer step: 3 s to the layer used last)
    assert r.complete and r.passes == 2 and (r.t_bwd0, r.t_bwd1) == (4.0, 13.0)
    t_f, t_b = r.times()
    assert t_f == [1.0 + 1.0 + 2.0 + 3.0, 2.0 + 1.0 + 1.0]
    assert t_b == [1.0 + 1.0 + 1.0 + 1.0, 1.0]
    assert sum(t_f) + sum(t_b) == 16.0  # the whole step: forward host time and both passes


def test_incomplete_step_is_an_error():
    r = StepRecorder([0], 1, clock=lambda: 0.0)
    r.forward_start()
    with pytest.raises(ValueError, match="incomplete"):
        r.times()


def test_merge_steps_takes_medians():
    steps = [([1.0, 2.0], [3.0, 4.0]), ([3.0, 2.0], [1.0, 4.0]), ([2.0, 8.0], [2.0, 0.0])]
    prof = merge_steps("m", ["a", "b"], [40, 80], steps, t_update=[0.1, 0.3, 0.2])
    assert [(layer.t_f, layer.t_b, layer.nbytes) for layer in prof.layers] == [(2.0, 2.0, 40), (2.0, 4.0, 80)]
    assert prof.t_update == pytest.approx(0.2)


def test_group_layers_and_expand():
    assert group_layers(["a", "a", "b", None, None]) == [[0, 1], [2], [3, 4]]
    s = builtin_schedule("dear", [1, 1, 1], 2)  # layers (0,1) and (2,)
    e = expand_layers(s, [[0, 1], [2], [3, 4]], keys=["f", "h", "f", "f", "f"])
    assert e.buckets == ((0,), (1,), (2,), (3, 4))
    assert e.describe() == "dear: 4 buckets: RS3 RS2 RS1 RS0 AG0 AG1 AG2 AG3"
