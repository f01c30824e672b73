"""The capture store's expected keys (what every forward must write), kept between steps: the kept list is
given back while nothing they depend on changed (one list object from the second call on, which the per-row byte sizes and the
arena's coverage answer are kept against), and made again when the captured layers change in place
(set_pipeline_stage's `&=`, a caller's discard) or the buffers learn a key. No engine: the store driven as
the runner hook drives it."""

from trace_vllm_plugin.capture import CaptureStore, ROUTING

from test_capture_step_run import CONFIG, SHAPE, SITES, Driver


def _sites(keys):
    return sorted(k for k in keys if k[0] != ROUTING)


def test_kept_while_unchanged_and_made_again_when_the_layers_change_in_place():
    store = CaptureStore(SHAPE, CONFIG)
    store.max_bytes = 1 << 30
    d = Driver(store)
    d.step(["a", "b"], [3, 1], [0, 0])
    first = store._expected_keys()
    assert first is store._expected_keys()  # the same list object while nothing changed
    assert _sites(first) == sorted((layer, s) for layer in range(SHAPE.num_layers) for s in SITES)
    assert [k for k in first if k[0] == ROUTING] == [(ROUTING, i) for i in SHAPE.moe_layer_list()]

    store.capture_layers.discard(1)  # in place: the same set object, other members
    narrowed = store._expected_keys()
    assert narrowed is not first
    assert _sites(narrowed) == sorted((0, s) for s in SITES)
    assert [k for k in narrowed if k[0] == ROUTING] == [(ROUTING, i) for i in SHAPE.moe_layer_list()]

    store.capture_layers.add(1)
    assert _sites(store._expected_keys()) == _sites(first)

    store.set_pipeline_stage(0, 2, [0])  # this stage holds layer 0 only: its routing ids and sites
    staged = store._expected_keys()
    assert set(staged) == {(ROUTING, 0)} | {(0, s) for s in SITES}
    d.step(["a", "b"], [1, 1], [3, 1])  # a step of the stage's keys is captured with them
    kept = store._expected_keys()
    assert kept == staged and kept is store._expected_keys()
