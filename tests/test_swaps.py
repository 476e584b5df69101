"""``hl_core.swaps``: a swapped attribute shows its newest layer; undoing layers in any order (two trainers finishing
in turn) leaves the newest remaining one, then the original as it was (an inherited method is not copied onto the
instance); a change made behind the swaps' back is refused, not overwritten; a context swap is seen by its own thread
only, while another thread sees its own stand-in or the original."""

import threading
import types

import pytest

from hl_core.swaps import Swap, SwapError, swap, swap_in_context, unswapped


class Engine:
    def step(self):
        return "original"


def test_a_swap_shows_its_value_and_undo_puts_the_original_back():
    target = types.SimpleNamespace(value=1)
    with swap(target, "value", 2) as handle:
        assert isinstance(handle, Swap) and handle.active and target.value == 2
        assert unswapped(target, "value") == 1
    assert target.value == 1 and not handle.active
    handle.undo()  # idempotent
    assert target.value == 1


def test_an_inherited_method_comes_back_from_the_class_not_as_a_copy_on_the_instance():
    engine = Engine()
    handle = swap(engine, "step", lambda: "stand-in")
    assert engine.step() == "stand-in"
    handle.undo()
    assert "step" not in vars(engine) and engine.step() == "original"


def test_an_absent_attribute_is_deleted_again():
    target = types.SimpleNamespace()
    with swap(target, "ref_model", "stand-in"):
        assert target.ref_model == "stand-in"
    assert not hasattr(target, "ref_model")


@pytest.mark.parametrize("order", [("a", "b"), ("b", "a")], ids=["first-in-first-out", "last-in-first-out"])
def test_interleaved_swaps_undo_in_any_order(order):
    """Two trainers swap one attribute and finish in either order: while one is left, its value shows; after both,
    the original."""
    target = types.SimpleNamespace(value="original")
    layers = {"a": swap(target, "value", "a"), "b": swap(target, "value", "b")}
    assert target.value == "b"  # the newest
    first, second = order
    layers[first].undo()
    assert target.value == second
    layers[second].undo()
    assert target.value == "original"


def test_three_layers_taken_out_of_the_middle():
    target = types.SimpleNamespace(value=0)
    a, b, c = swap(target, "value", 1), swap(target, "value", 2), swap(target, "value", 3)
    b.undo()
    assert target.value == 3
    c.undo()
    assert target.value == 1
    a.undo()
    assert target.value == 0


def test_a_change_behind_the_swaps_back_is_refused_not_overwritten():
    target = types.SimpleNamespace(value=1)
    handle = swap(target, "value", 2)
    target.value = 99  # someone else's assignment
    with pytest.raises(SwapError, match=r"SimpleNamespace\.value` was replaced while swapped.*Fix:"):
        handle.undo()
    assert target.value == 99


def test_one_attribute_takes_one_kind_of_swap():
    module = types.ModuleType("fake")
    module.f = lambda: "original"
    with swap_in_context(module, "f", lambda: "mine"):
        with pytest.raises(SwapError, match="one kind only"):
            swap(module, "f", lambda: "global")
    assert module.f() == "original"
    with pytest.raises(TypeError, match="replaces a callable"):
        swap_in_context(types.SimpleNamespace(x=1), "x", 2)


def test_a_context_swap_is_seen_by_its_own_thread_only():
    """Two threads (two trainers) swap the same module function at once, each its own stand-in, and call it while
    both are in place: each sees its own; the main thread sees the original throughout; after both, it is back."""
    module = types.ModuleType("trl_like")
    module.log_probs = lambda x: ("trl", x)
    original = module.log_probs
    both_in, seen = threading.Barrier(3), {}

    def trainer(name):
        with swap_in_context(module, "log_probs", lambda x: (name, x)):
            both_in.wait()  # both swaps are in place now
            seen[name] = module.log_probs(1)
            both_in.wait()  # neither undoes before the other has called

    threads = [threading.Thread(target=trainer, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    both_in.wait()
    seen["main"] = module.log_probs(1)
    both_in.wait()
    for thread in threads:
        thread.join()
    assert seen == {"a": ("a", 1), "b": ("b", 1), "main": ("trl", 1)}
    assert module.log_probs is original and unswapped(module, "log_probs") is original


def test_nested_context_swaps_show_the_newest_then_the_older():
    module = types.ModuleType("m")
    module.f = lambda: "original"
    with swap_in_context(module, "f", lambda: "outer"):
        with swap_in_context(module, "f", lambda: "inner"):
            assert module.f() == "inner"
        assert module.f() == "outer"
    assert module.f() == "original"


def test_use_cpu_as_a_context_manager_takes_its_shims_out_and_leaves_others():
    """``hl_core.mcore.use_cpu()`` puts the megatron-core CPU shims in place as swaps: a ``with`` block's shims are
    gone after it (``torch.cuda.current_device``, ``Module.cuda`` and the schedules' ``torch`` as they were), while
    shims taken as a statement, before it, stay."""
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.pipeline_parallel import schedules

    from hl_core import mcore

    if torch.cuda.is_available():
        pytest.skip("the CPU shims refuse to run where CUDA is available")
    originals = (torch.cuda.current_device, schedules.torch, "cuda" in vars(torch.nn.Module))
    with mcore.use_cpu() as shims:
        assert torch.cuda.current_device() == "cpu" and shims.active
        assert torch.nn.Module().cuda is not None and schedules.torch is not torch
    assert (torch.cuda.current_device, schedules.torch, "cuda" in vars(torch.nn.Module)) == originals
    kept = mcore.use_cpu()
    with mcore.use_cpu():
        pass
    assert torch.cuda.current_device() == "cpu" and kept.active  # the statement's shims outlive the block's
    kept.undo()
    assert (torch.cuda.current_device, schedules.torch) == originals[:2] and not kept.active
