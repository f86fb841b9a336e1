"""forge_dsl.OffloadActivations: saved tensors in host memory give the same bits as keeping them on the device.

Every test runs on the GPU when there is one (pinned host memory, side-stream copies, prefetching) and otherwise
on the CPU (the same bookkeeping with synchronous copies into separate buffers); the ones about streams and
device memory are GPU-only."""

import contextlib
import gc
import weakref

import pytest
import torch
import transformers

import forge_dsl
from forge_dsl.training.offload import OffloadActivations, _Saved
from tiers import sweep

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def tiny_llama(seed: int, layers: int = 3) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      tie_word_embeddings=False, pad_token_id=None, bos_token_id=None,
                                      eos_token_id=None)
    return transformers.LlamaForCausalLM(config).to(DEVICE)


def checkpoint_layers(model, reentrant: bool = False) -> None:
    """Activation checkpointing of every decoder layer (transformers' name changed in v5)."""
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def ids(seed: int, tokens: int = 24) -> torch.Tensor:
    return torch.randint(0, 96, (2, tokens), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def train(model, make_optimizer, offload, steps: int = 2) -> list:
    """`steps` steps on fresh random ids, each forward within `offload` (when given); the losses."""
    opt = make_optimizer(model)
    losses = []
    for step in range(steps):
        batch = ids(100 + step)
        if offload is not None:
            with offload:
                loss = model(input_ids=batch, labels=batch).loss
        else:
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses


OPTIMIZERS = {
    "torch-adamw": lambda model: torch.optim.AdamW(model.parameters(), lr=1e-2),
    # the fused backward updates the linear weights inside backward, from the unpacked inputs
    "forge-adamw-int8": lambda model: forge_dsl.ForgeOptimizer(model, "adamw", lr=1e-2, state_dtype="int8"),
}


# the quick tier: torch's AdamW with each checkpointing, FORGE's (about 5 s each) with non-reentrant checkpointing
@pytest.mark.parametrize(*sweep(("checkpointing", ["non-reentrant", "reentrant", "off"]),
                                ("optimizer", list(OPTIMIZERS)),
                                quick=["non-reentrant-torch-adamw", "reentrant-torch-adamw", "off-torch-adamw",
                                       "non-reentrant-forge-adamw-int8"]))
def test_training_is_bit_for_bit_the_same_with_offloading(optimizer, checkpointing):
    models = [tiny_llama(seed=0) for _ in range(2)]
    if checkpointing != "off":
        for model in models:
            checkpoint_layers(model, reentrant=checkpointing == "reentrant")
    offload = OffloadActivations(min_bytes=1, device=DEVICE.type)
    plain = train(models[0], OPTIMIZERS[optimizer], None)
    offloaded = train(models[1], OPTIMIZERS[optimizer], offload)
    assert torch.equal(torch.stack(plain), torch.stack(offloaded))
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(a, b), name
    assert offload.bytes_offloaded > 0
    # every offloaded tensor came back (a tensor saved by several operations may come back more than once)
    assert offload.bytes_restored >= offload.bytes_offloaded


def test_checkpoint_inputs_come_back_last_layer_first_each_prefetched_by_the_one_after_it():
    model = tiny_llama(seed=1, layers=4)
    checkpoint_layers(model)
    batch = ids(3)
    offload = OffloadActivations(min_bytes=1, device=DEVICE.type)
    inputs = []  # each decoder layer's input, in forward order
    hooks = [layer.register_forward_pre_hook(lambda m, args, kwargs: inputs.append(args[0] if args else
                                                                                  kwargs["hidden_states"]),
                                             with_kwargs=True) for layer in model.model.layers]
    came_back = []  # (entry, whether it was on its way back before backward asked for it), in unpack order
    unpack = offload.unpack

    def watched(saved):
        if isinstance(saved, _Saved) and saved.entry.on_device() is None:
            came_back.append((saved.entry, saved.entry.prefetched is not None))
        return unpack(saved)

    with torch.autograd.graph.saved_tensors_hooks(offload.pack, watched):
        loss = model(input_ids=batch, labels=batch).loss
    for hook in hooks:
        hook.remove()
    entries = [offload._by_tensor[id(t)][1]() for t in inputs]
    del inputs
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
        offload._release_copied()
    loss.backward()
    order = [entries.index(e) for e, _ in came_back if any(e is x for x in entries)]
    assert order == [3, 2, 1, 0]  # the last layer's input first
    prefetched = {entries.index(e): ahead for e, ahead in came_back if any(e is x for x in entries)}
    # each layer's input was on its way back while the layer after it ran its backward
    assert [prefetched[i] for i in (2, 1, 0)] == [True, True, True]
    assert offload.bytes_prefetched > 0


def test_an_unpack_whose_copy_is_still_in_flight_prefetches_too():
    """Backward's first unpacks often find their copies to the host still running (the device tensor is used as
    is); they must start bringing back the tensor saved before all the same. The copy in flight is simulated on
    any device: the entry holds its source again."""
    offload = OffloadActivations(min_bytes=1, device=DEVICE.type)
    x = torch.randn(32, 32, device=DEVICE, requires_grad=True)
    with offload:
        h1 = x * 2.0
        h2 = h1.sin() * 3.0  # sin saves h1 (first)
        y = h2.sin().sum()  # sin saves h2 (second)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
        offload._release_copied()
    first, second = (offload._by_order[i]() for i in range(2))
    second.source = h2.detach()  # its copy "still in flight"
    del h1, h2
    y.backward()
    assert offload.bytes_prefetched == first.host.nbytes


def test_without_prefetch_nothing_is_prefetched_and_the_bits_are_the_same():
    models = [tiny_llama(seed=2) for _ in range(2)]
    for model in models:
        checkpoint_layers(model)
    offload = OffloadActivations(min_bytes=1, device=DEVICE.type, prefetch=False)
    plain = train(models[0], OPTIMIZERS["torch-adamw"], None)
    offloaded = train(models[1], OPTIMIZERS["torch-adamw"], offload)
    assert torch.equal(torch.stack(plain), torch.stack(offloaded))
    assert offload.bytes_prefetched == 0 and offload.bytes_restored >= offload.bytes_offloaded > 0


def test_which_tensors_are_moved():
    offload = OffloadActivations(min_bytes=1024, device=DEVICE.type)
    base = torch.randn(64, 64, device=DEVICE) * 1.0  # 16 KiB, not a leaf that requires grad
    moved = offload.pack(base)
    assert offload.moved(moved) and isinstance(moved, _Saved)

    class Marked(torch.Tensor):
        pass

    kept = {
        "parameter": torch.nn.Parameter(torch.randn(64, 64, device=DEVICE)),
        "leaf that requires grad": torch.randn(64, 64, device=DEVICE, requires_grad=True),
        "view of part of a storage": base[1:],
        "not contiguous": base.t(),
        "under min_bytes": torch.randn(8, 8, device=DEVICE) * 1.0,
        "another device type": torch.randn(64, 64, device="meta"),
        "a subclass": torch.randn(64, 64, device=DEVICE).as_subclass(Marked),
    }
    for what, tensor in kept.items():
        packed = offload.pack(tensor)
        assert not offload.moved(packed), what
        assert offload.unpack(packed) is not tensor, what  # detached: it must not hold the graph
        if tensor.device.type != "meta":
            assert torch.equal(offload.unpack(packed), tensor), what
    assert offload.bytes_offloaded == base.numel() * 4
    assert torch.equal(offload.unpack(moved), base)


def grad_of(f, x: torch.Tensor, context) -> torch.Tensor:
    x = x.detach().requires_grad_()
    with context:
        y = f(x)
    y.backward()
    return x.grad


def test_a_tensor_saved_twice_is_copied_once():
    offload = OffloadActivations(min_bytes=1, device=DEVICE.type)
    x = torch.randn(32, 32, device=DEVICE)
    product = lambda x: ((x * 3.0) * (x * 3.0).exp()).sum()  # noqa: E731  mul saves both, exp its output
    twice = lambda x: (lambda h: (h * h).sum())(x * 3.0)  # noqa: E731  mul saves h twice
    assert torch.equal(grad_of(twice, x, offload), grad_of(twice, x, contextlib.nullcontext()))
    assert offload.bytes_offloaded == x.numel() * 4
    assert torch.equal(grad_of(product, x, offload), grad_of(product, x, contextlib.nullcontext()))


def test_a_saved_tensor_can_be_unpacked_again_with_retain_graph():
    offload = OffloadActivations(min_bytes=1, device=DEVICE.type)
    x = torch.randn(16, 16, device=DEVICE, requires_grad=True)
    with offload:
        y = (x * 1.5).sin().sum()
    y.backward(retain_graph=True)
    first = x.grad.clone()
    y.backward()
    assert torch.equal(x.grad, 2 * first)
    assert torch.equal(first, grad_of(lambda x: (x * 1.5).sin().sum(), x, contextlib.nullcontext()))


def test_the_device_tensor_is_freed_once_copied():
    offload = OffloadActivations(min_bytes=1, device=DEVICE.type)
    x = torch.randn(64, 64, device=DEVICE, requires_grad=True)
    with offload:
        h = x * 2.0
        y = h.sin().sum()  # sin saves h
        ref = weakref.ref(h)
        del h
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
    gc.collect()
    assert ref() is None  # only the host copy is left
    y.backward()
    assert torch.equal(x.grad, grad_of(lambda x: (x * 2.0).sin().sum(), x, contextlib.nullcontext()))


@pytest.mark.parametrize("kwargs, error, words", [
    ({"min_bytes": 1.5}, TypeError, "min_bytes must be an int"),
    ({"min_bytes": True}, TypeError, "min_bytes must be an int"),
    ({"min_bytes": -1}, ValueError, "min_bytes must be >= 0"),
    ({"device": "xpu"}, ValueError, "device must be 'cuda' or 'cpu'"),
    ({"prefetch": 1}, TypeError, "prefetch must be a bool"),
    ({"max_in_flight_bytes": 2.0}, TypeError, "max_in_flight_bytes must be an int"),
    ({"max_in_flight_bytes": -1}, ValueError, "max_in_flight_bytes must be >= 0"),
])
def test_bad_arguments_are_refused(kwargs, error, words):
    with pytest.raises(error, match=words):
        OffloadActivations(**kwargs)


@pytest.mark.gpu
def test_a_tensor_modified_in_place_before_its_copy_finished_is_refused():
    """The compute stream is held busy, so the copy to host cannot have started when the saved tensor is modified
    in place: backward says so instead of using the new values (whether the copy has run by then or not)."""
    offload = OffloadActivations(min_bytes=1)
    x = torch.randn(256, 256, device="cuda", requires_grad=True)
    with offload:
        h = x * 2.0
        torch.cuda._sleep(50_000_000)  # the side stream's copy waits for this
        y = h.sin().sum()
        with torch.no_grad():
            h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an in-place operation after it was saved"):
        y.backward()


@pytest.mark.gpu
def test_checkpoint_inputs_leave_the_gpu():
    """With activation checkpointing, what a forward leaves allocated on the GPU drops by the layers' inputs."""
    model = tiny_llama(seed=4, layers=4)
    checkpoint_layers(model)
    batch = ids(5, tokens=2048)
    offload = OffloadActivations()  # 1 MiB: a layer's input here is 2 × 2048 × 64 × 4 bytes

    def forward_bytes(context):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with context:
            loss = model(input_ids=batch, labels=batch).loss
            torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated() - before
        loss.backward()
        model.zero_grad(set_to_none=True)
        return allocated

    kept = forward_bytes(contextlib.nullcontext())
    moved = forward_bytes(offload)
    layer_input = 2 * 2048 * 64 * 4
    assert kept - moved >= 4 * layer_input


@pytest.mark.gpu
@pytest.mark.parametrize("limit_mib", [0, 2])
def test_a_forward_ahead_of_the_gpu_holds_at_most_max_in_flight_bytes_waiting_for_their_copies(limit_mib):
    """The compute stream is held busy, so no copy to the host can run: saving waits for the oldest copy once more
    than max_in_flight_bytes wait beside the newest, and what stays allocated is bounded by it."""
    mib = 1 << 20
    offload = OffloadActivations(max_in_flight_bytes=limit_mib * mib)
    x = torch.randn(mib // 4, device="cuda", requires_grad=True)
    ys = []
    torch.cuda.synchronize()
    with offload:
        torch.cuda._sleep(20_000_000)
        before = torch.cuda.memory_allocated()
        for _ in range(8):
            ys.append((x * 2.0).sin())  # sin saves its 1 MiB input
            in_flight = sum(e.host.numel() * e.host.element_size() for e in offload._pending)
            assert in_flight <= (limit_mib + 1) * mib
            # the saved inputs still on the device: the ones waiting for their copies
            assert torch.cuda.memory_allocated() - before <= 8 * mib + (limit_mib + 1) * mib
    sum(y.sum() for y in ys).backward()
    expected = sum((x.detach() * 2.0).cos() * 2.0 for _ in range(8))
    assert torch.allclose(x.grad, expected)
    assert offload.bytes_offloaded == 8 * mib


def test_a_compiled_module_saves_through_it_bit_for_bit():
    """torch.compile's graphs save their tensors for backward at run time, so they go through the hooks too."""
    torch.manual_seed(6)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)).to(DEVICE)
    compiled = torch.compile(net)
    x = torch.randn(16, 32, device=DEVICE)
    grads = []
    offload = OffloadActivations(min_bytes=1, device=DEVICE.type)
    for context in (contextlib.nullcontext(), offload):
        with context:
            y = compiled(x).square().sum()
        y.backward()
        grads.append([p.grad.clone() for p in net.parameters()])
        net.zero_grad(set_to_none=True)
    assert offload.bytes_offloaded > 0
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("size", [4, 64], ids=["kept", "moved"])
def test_a_saved_tensor_modified_in_place_is_refused_as_autograd_refuses_it(size):
    """The hooks replace autograd's version check: a saved tensor changed in place after it was saved, whether it
    stayed on the device (under min_bytes) or was copied to the host, is refused in backward, not used."""
    offload = OffloadActivations(min_bytes=1024, device=DEVICE.type)
    x = torch.randn(size, size, device=DEVICE, requires_grad=True)
    with offload:
        h = x * 2.0
        y = h.sin().sum()  # sin saves h
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()  # the copy to the host is done
    with torch.no_grad():
        h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an in-place operation after it was saved"):
        y.backward()


def test_a_forward_without_backward_frees_its_graph():
    """What the hooks return must not hold the graph: exp saves its own output, and a forward with grad enabled
    but no backward (an evaluation without no_grad) must leave nothing alive once its outputs are dropped."""
    offload = OffloadActivations(min_bytes=1, device=DEVICE.type)
    x = torch.randn(64, 64, device=DEVICE, requires_grad=True)
    refs = []
    for min_bytes in (1, 1 << 30):  # moved, and kept
        offload.min_bytes = min_bytes
        with offload:
            h = (x * 2.0).exp()  # exp saves its output h
            refs.append(weakref.ref(h))
        del h
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
        offload._release_copied()
    gc.collect()
    assert [r() for r in refs] == [None, None]
