"""A managed parameter's state machine (zinf/_param.py): the states one training step moves a
parameter through, in a real engine and transition by transition; the refusal of an illegal
transition (a ZinfError with code "Internal" naming the parameter, the state it was in and the
moves the transition makes), which leaves the state as it was; and a forward acquire that
fails midway, which puts every parameter back in the state it had (_residency.py).
"""
import pytest
import torch
import torch.nn as nn

import zinf
from conftest import make_config
from zinf._param import GradState, ManagedParam, ParamState


class _Owner:
    """Stands for the engine a ManagedParam refers to (weakly)."""


def _record(name="lin.weight", shape=(3, 2)):
    owner = _Owner()
    param = nn.Parameter(torch.randn(shape))
    p = ManagedParam(7, param, [name], torch.float32, torch.device("cpu"), owner)
    p.source = param.detach().clone()
    return p, owner


def test_one_step_moves_a_parameter_through_its_states():
    p, _ = _record()
    assert (p.state, p.grad_state) == (ParamState.REGISTERED, GradState.PENDING)
    p.finish_registration()
    assert p.state is ParamState.RELEASED and p.source is None
    memory = torch.arange(6, dtype=torch.float32)
    p.gather_forward(memory)  # forward: param.data is the engine's memory
    assert p.state is ParamState.FORWARD and p.state.in_forward
    assert p.param.data.data_ptr() == memory.data_ptr() and p.param.shape == (3, 2)
    p.release_forward()
    assert p.state is ParamState.RELEASED
    assert torch.isnan(p.param.data).all() and p.param.data.stride() == (0, 0)
    p.gather_backward(memory)  # backward: a saved reference unpacked
    assert p.state is ParamState.BACKWARD and p.bwd_flat is memory
    p.gather_forward(memory)  # a checkpointed segment recomputed in that backward
    assert p.state is ParamState.FORWARD_BACKWARD
    p.release_forward()
    assert p.state is ParamState.BACKWARD
    p.reduce_gradient()
    assert p.grad_state is GradState.REDUCED
    p.release_backward()
    assert p.state is ParamState.RELEASED and p.bwd_flat is None
    p.end_micro_step()  # engine.step()
    assert p.grad_state is GradState.PENDING


@pytest.mark.parametrize("setup, transition, current, move", [
    ([], "gather_forward", "REGISTERED", "RELEASED -> FORWARD"),
    (["finish_registration"], "finish_registration", "RELEASED", "REGISTERED -> RELEASED"),
    (["finish_registration"], "release_forward", "RELEASED", "FORWARD -> RELEASED"),
    (["finish_registration", "gather_forward"], "gather_forward", "FORWARD",
     "BACKWARD -> FORWARD_BACKWARD"),
    (["finish_registration"], "release_backward", "RELEASED", "BACKWARD -> RELEASED"),
    (["finish_registration", "gather_backward"], "gather_backward", "BACKWARD",
     "FORWARD -> FORWARD_BACKWARD"),
    (["reduce_gradient"], "reduce_gradient", "REDUCED", "PENDING -> REDUCED"),
])
def test_an_illegal_transition_is_refused_naming_the_parameter_and_states(
        setup, transition, current, move):
    p, _ = _record("blocks.0.attn.weight")
    memory = torch.zeros(6)
    for name in setup:
        if name.startswith("gather"):
            getattr(p, name)(memory)
        else:
            getattr(p, name)()
    before = (p.state, p.grad_state, p.fwd_live, p.bwd_flat)
    args = (memory,) if transition.startswith("gather") else ()
    with pytest.raises(RuntimeError) as e:
        getattr(p, transition)(*args)
    assert isinstance(e.value, zinf.ZinfError) and e.value.code == "Internal"
    message = str(e.value)
    assert "'blocks.0.attn.weight'" in message
    assert "%s in state %s" % (transition, current) in message
    assert move in message
    after = (p.state, p.grad_state, p.fwd_live, p.bwd_flat)
    assert all(a is b for a, b in zip(before, after)), "nothing changes on a refusal"


def test_an_engine_step_moves_its_parameters_through_the_states():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    engine = zinf.initialize(model, make_config(), device="cpu")
    recs = [p._zinf_rec for p in model.parameters()]
    weight = model[0].weight._zinf_rec
    assert all(r.state is ParamState.REGISTERED for r in recs)
    seen = []
    model[0].register_forward_pre_hook(lambda m, i: seen.append(weight.state))
    loss = engine(torch.randn(5, 4)).square().sum()
    assert seen == [ParamState.FORWARD]
    assert all(r.state is ParamState.RELEASED for r in recs)  # saved as references
    loss.backward(retain_graph=True)  # the retained graph's references keep their holds
    assert model[2].weight._zinf_rec.state is ParamState.BACKWARD
    assert all(r.grad_state is GradState.REDUCED for r in recs)
    engine.step()
    assert all((r.state, r.grad_state) == (ParamState.RELEASED, GradState.PENDING)
               for r in recs)
    engine.close()


def test_an_engine_refuses_a_second_gradient_before_the_state_machine_would():
    """The user's mistake gets the engine's message (what to do), not the internal one."""
    model = nn.Sequential(nn.Linear(4, 2))
    engine = zinf.initialize(model, make_config(), device="cpu")
    engine.backward(engine(torch.randn(3, 4)).sum())
    with pytest.raises(zinf.ZinfError, match="second gradient in one micro-step") as e:
        engine.backward(engine(torch.randn(3, 4)).sum())
    assert e.value.code == "FailedPrecondition"
    engine.step()
    assert all(p._zinf_rec.grad_state is GradState.PENDING for p in model.parameters())
    engine.close()


class _FakeCore:
    """The engine's acquire/release: the same memory for a parameter each time (of the wrong
    size for the ids in `broken`)."""

    def __init__(self, broken=()):
        self.memory = {i: torch.zeros(5) for i in broken}
        self.released = []

    def acquire(self, ids, inference=False):
        return [torch.utils.dlpack.to_dlpack(self.memory.setdefault(i, torch.zeros(6)))
                for i in ids]

    def release(self, ids):
        self.released.append(list(ids))


def test_a_failed_forward_acquire_rolls_back_to_the_states_before_it():
    from zinf._microstep import MicroStep
    from zinf._registry import ParamRegistry
    from zinf._residency import Frame, Residency

    class Engine:
        _core = _FakeCore(broken=[8])  # b's memory cannot be viewed in its shape

    engine, registry = Engine(), ParamRegistry()
    (p, _), (q, _) = _record("a"), _record("b")
    q.id = 8
    registry.params = [p, q]
    for r in registry.params:
        r.finish_registration()
    residency = Residency(engine, registry, MicroStep(1))
    residency.acquire_backward(p)  # backward holds p (a saved reference unpacked)
    assert p.state is ParamState.BACKWARD and residency.holder_of(p.bwd_flat) is p

    frame = Frame()
    with pytest.raises(RuntimeError, match="shape"):
        residency.acquire_forward([p, q], frame, inference=True)
    assert (p.state, q.state) == (ParamState.BACKWARD, ParamState.RELEASED)
    assert residency.holder_of(p.bwd_flat) is p, "backward's memory is still known"
    assert engine._core.released[-1] == [p.id, q.id] and frame.params == []


def test_a_failed_backward_acquire_gives_the_parameter_back():
    from zinf._microstep import MicroStep
    from zinf._registry import ParamRegistry
    from zinf._residency import Residency

    class Engine:
        _core = _FakeCore()

    engine, registry = Engine(), ParamRegistry()
    p, _ = _record("a")
    registry.params = [p]
    residency = Residency(engine, registry, MicroStep(1))
    # Still REGISTERED: the backward transition is refused after the engine's acquire.
    with pytest.raises(zinf.ZinfError, match="gather_backward in state REGISTERED"):
        residency.acquire_backward(p)
    assert p.state is ParamState.REGISTERED
    assert engine._core.released == [[7]], "the acquisition is released, once"
