"""``dx.settled_heap``: the collector set up for a training loop, and restored after."""
import gc
import weakref

import pytest

import dynax as dx
from dynax.heap import TRAINING_THRESHOLD


@pytest.fixture(autouse=True)
def _collector_as_found():
    before = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    yield
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before


def test_inside_the_heap_is_frozen_and_collections_are_rare_then_all_is_restored():
    before = gc.get_threshold()
    with dx.settled_heap():
        assert gc.get_freeze_count() > 1000  # the test process, JAX included
        assert gc.get_threshold() == (TRAINING_THRESHOLD,) + before[1:]
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before
    with dx.settled_heap(1234):
        assert gc.get_threshold()[0] == 1234


def test_an_error_inside_leaves_the_collector_as_it_was():
    before = gc.get_threshold()
    with pytest.raises(KeyError, match="inside the loop"):
        with dx.settled_heap(10):
            raise KeyError("inside the loop")
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before


def test_a_nested_block_is_part_of_the_outer_one():
    with dx.settled_heap(5000):
        frozen = gc.get_freeze_count()
        with dx.settled_heap(99):
            assert gc.get_threshold()[0] == 5000 and gc.get_freeze_count() == frozen
        assert gc.get_threshold()[0] == 5000 and gc.get_freeze_count() == frozen


def test_blocks_closed_out_of_order_restore_when_the_last_one_closes():
    """As threads may close theirs: the collector is the process's."""
    before = gc.get_threshold()
    first, second = dx.settled_heap(5000), dx.settled_heap(99)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert gc.get_threshold()[0] == 5000 and gc.get_freeze_count() > 1000
    second.__exit__(None, None, None)
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before


def test_cycles_made_inside_are_still_collected_by_the_collector_itself():
    class Node:
        pass

    collected = []
    with dx.settled_heap(100):
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle: reference counting cannot free it
        weakref.finalize(a, collected.append, "a")
        del a, b
        # a few thousand tracked allocations: the collector runs without being asked
        keep = [[] for _ in range(5000)]
        assert collected == ["a"]
    del keep


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "100", None])
def test_a_threshold_that_is_not_a_positive_int_is_refused(bad):
    with pytest.raises(ValueError, match=f"threshold must be a positive int, got {bad!r}"):
        with dx.settled_heap(bad):
            pass
