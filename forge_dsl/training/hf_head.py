"""The loss without logits for Hugging Face causal LMs: `model(..., labels=...)` computes `head_loss.causal_lm_loss`.

    handle = install(model, sink_for=lambda weight: sink)       a Hugging Face causal LM computes its loss so
    handle.remove()                                             the model as it was

Which models: those whose forward is `logits = lm_head(hidden)` then the causal-LM loss, nothing between
(`SUPPORTED_MODEL_TYPES`); `check_installable` says why another is refused.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any, Callable, Optional

import torch

from . import tensor_parallel
from .head_loss import causal_lm_loss
from .row_updates import RowSink

__all__ = ["SUPPORTED_MODEL_TYPES", "HeadHandle", "check_installable", "install"]

SUPPORTED_MODEL_TYPES = frozenset({"gemma", "glm", "helium", "llama", "ministral", "mistral", "olmo2", "phi3",
                                   "qwen2", "qwen3", "smollm3", "starcoder2"})
"""Model types whose CausalLM forward is `logits = lm_head(hidden)` then `loss_function(logits, labels, ...)`
with nothing between (tests/training/test_head_loss.py checks each against its own forward)."""

_LOGIT_CHANGES = {
    "final_logit_softcapping": "soft-caps the logits (tanh)",
    "logit_scale": "scales the logits",
    "logits_scaling": "divides the logits by a constant",
}
"""Config attributes with which a model changes its logits after lm_head, which this loss does not do."""

_MISSING = object()


def _own_forward(model: torch.nn.Module) -> Callable:
    return functools.partial(type(model).forward, model)


def _is_dormant_forward(model: torch.nn.Module, forward: Any) -> bool:
    """Whether `forward` (an instance attribute) is what a copy of an installed model holds: its class's forward
    bound to it (`_HeadForward.__reduce__`)."""
    return (isinstance(forward, functools.partial) and forward.func is type(model).forward
            and len(forward.args) == 1 and forward.args[0] is model and not forward.keywords)


def _refusal(model: Any) -> Optional[str]:
    """Why `install` cannot give this model the loss without logits exactly (None: it can)."""
    if not isinstance(model, torch.nn.Module):
        return f"expected a Hugging Face causal LM (an nn.Module), got {type(model).__name__}"
    config = getattr(model, "config", None)
    for attr, what in _LOGIT_CHANGES.items():
        if getattr(config, attr, None) is not None:
            return (f"{type(model).__name__} {what} after lm_head (config.{attr} = {getattr(config, attr)!r}), "
                    f"which the loss without logits does not do; train it with its own loss")
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return (f"{type(model).__name__} has model_type {model_type!r}; install supports the model types whose "
                f"forward is lm_head(hidden) then the causal-LM loss ({', '.join(sorted(SUPPORTED_MODEL_TYPES))}). "
                f"Call forge_dsl.training.head_loss.causal_lm_loss on its hidden states instead")
    inner, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    if not isinstance(inner, torch.nn.Module) or not isinstance(head, torch.nn.Module):
        return f"{type(model).__name__} lacks model.model (the decoder) or model.lm_head (an nn.Linear)"
    if type(head) is not torch.nn.Linear:
        return (f"model.lm_head is a {type(head).__qualname__}, not a plain nn.Linear (its forward may compute "
                f"something else, e.g. a quantized or adapted head)")
    if head.bias is not None:
        return "model.lm_head has a bias, which the loss without logits does not add"
    if head.weight.shape[0] != getattr(config, "vocab_size", None):
        return f"model.lm_head has {head.weight.shape[0]} outputs but config.vocab_size is {config.vocab_size}"
    if tensor_parallel.is_dtensor(head.weight):
        return ("model.lm_head is sharded with tensor parallelism (a DTensor weight): the loss without logits "
                "would need a log-sum-exp across the ranks' vocabulary shards, which it does not compute. Train "
                "with the model's own loss (FORGE still updates the sharded head inside backward)")
    if head._forward_hooks or head._forward_pre_hooks:
        return "model.lm_head has forward hooks, which the loss without logits would skip (it never calls lm_head)"
    return None


def _loss_refusal(model: torch.nn.Module) -> Optional[str]:
    from transformers.loss.loss_utils import ForCausalLMLoss

    if model.loss_function is not ForCausalLMLoss:
        return (f"model.loss_function is {getattr(model.loss_function, '__name__', model.loss_function)!r}, "
                f"not transformers' ForCausalLMLoss, which is what the loss without logits computes")
    return None


class _HeadForward:
    """The instance-level `forward` of an installed causal LM: with `labels`, `model.model(...)` then
    `causal_lm_loss` (the output's `logits` is None); without, the model's own forward. A copy (deepcopy,
    pickle, `torch.save`) is the class's forward bound to the copied model: a copied model is a plain model."""

    __slots__ = ("model_ref", "sink_for", "block_rows", "previous", "signature", "__signature__", "__weakref__")

    def __init__(self, model: torch.nn.Module, sink_for: Optional[Callable], block_rows: Optional[int]) -> None:
        self.model_ref = weakref.ref(model)
        self.sink_for = sink_for
        self.block_rows = block_rows
        self.previous = model.__dict__.get("forward", _MISSING)  # a copy's dormant forward, or nothing
        self.signature = inspect.signature(type(model).forward)
        self.__signature__ = inspect.signature(_own_forward(model))  # what GenerationMixin inspects

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model_ref()
        arguments = self.signature.bind_partial(model, *args, **kwargs).arguments
        labels = arguments.get("labels")
        if labels is None:
            return type(model).forward(model, *args, **kwargs)
        why = _refusal(model) or _loss_refusal(model)
        if why is not None:
            raise RuntimeError(f"forge_dsl.training.hf_head: {why}; call handle.remove() to use the model's own loss")
        arguments = dict(arguments)
        arguments.pop(next(iter(arguments)))  # self
        for name, p in self.signature.parameters.items():
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(arguments.pop(name, {}))
        del arguments["labels"]
        for name in ("logits_to_keep", "num_logits_to_keep"):
            keep = arguments.pop(name, 0)
            if not (keep is None or (isinstance(keep, int) and keep == 0)):
                raise ValueError(f"{name}={keep!r} with labels: the loss without logits computes the loss over every "
                                 f"position; leave {name} at 0 when labels are given")
        return_dict = arguments.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(model.config, "return_dict", True)
        outputs = model.model(**arguments, return_dict=True)
        weight = model.lm_head.weight
        tied = weight is model.get_input_embeddings().weight
        sink = None if tied or self.sink_for is None or not weight.requires_grad else self.sink_for(weight)
        loss = causal_lm_loss(outputs.last_hidden_state, weight, labels, sink=sink,
                              ignore_index=arguments.get("ignore_index", -100),
                              num_items_in_batch=arguments.get("num_items_in_batch"),
                              shift_labels=arguments.get("shift_labels"), block_rows=self.block_rows)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        out = CausalLMOutputWithPast(loss=loss, logits=None,
                                     **{k: v for k, v in outputs.items() if k != "last_hidden_state"})
        return out if return_dict else out.to_tuple()

    def restore(self) -> None:
        """Give the model back the forward it had before `install`."""
        model = self.model_ref()
        if model is not None and model.__dict__.get("forward") is self:
            if self.previous is _MISSING:
                del model.forward
            else:
                model.forward = self.previous

    def __reduce__(self):
        return _own_forward(self.model_ref()).__reduce__()


class HeadHandle:
    """What `install` returns: `remove()` gives the model back the forward it had (again: nothing)."""

    def __init__(self, forward: _HeadForward) -> None:
        self._forward = forward

    def remove(self) -> None:
        self._forward.restore()

    def describe(self) -> str:
        """Which model and head this loss is installed on, and whether it is still."""
        model = self._forward.model_ref()
        if model is None:
            return "its model no longer exists"
        installed = model.__dict__.get("forward") is self._forward
        return (f"{type(model).__name__}.forward with labels, lm_head.weight updated a vocabulary block at a time"
                + ("" if installed else " (removed)"))


def check_installable(model: torch.nn.Module) -> None:
    """Raise the ValueError `install` would raise for `model` (nothing where it can be installed)."""
    why = _refusal(model)
    if why is None:
        forward = model.__dict__.get("forward", _MISSING)
        if isinstance(forward, _HeadForward):
            why = "it is already installed on this model; call the handle's remove() first"
        elif forward is not _MISSING and not _is_dormant_forward(model, forward):
            why = ("the model's forward was replaced on the instance (e.g. by a hook library), which install "
                   "does not replace")
    if why is not None:
        raise ValueError(f"forge_dsl.training.hf_head.install: {why}")


def install(model: torch.nn.Module, sink_for: Optional[Callable[[torch.nn.Parameter], Optional[RowSink]]] = None, *,
            block_rows: Optional[int] = None) -> HeadHandle:
    """Make a Hugging Face causal LM (`model.model` + `model.lm_head`, a model type in `SUPPORTED_MODEL_TYPES`)
    compute its loss without logits: `model(input_ids, labels=labels, ...)` runs `model.model(...)` and
    `causal_lm_loss` on its last hidden state, and returns the usual `CausalLMOutputWithPast` with
    `logits=None`; `num_items_in_batch`, `shift_labels` and `ignore_index` are read as the model's own loss
    reads them. Without `labels` (generation, evaluation's logits) the model's own forward runs, unchanged.

    `sink_for(lm_head.weight)`, called at each forward with labels, gives the sink that updates the head inside
    backward (None: autograd gets the dense dW, exact). A head tied to the input embeddings (`lm_head.weight is
    model.get_input_embeddings().weight`) always gives autograd its dense dW, whatever `sink_for` says: the tied
    weight's update needs both uses' gradients. Under `torch.compile` the loss is the plain path (see
    `causal_lm_loss`). `copy.deepcopy(model)`, pickle and `torch.save(model)` give a plain model.

    Refused (ValueError): a model whose logits are changed after lm_head (Gemma2's `final_logit_softcapping`,
    Cohere's `logit_scale`, Granite's `logits_scaling`), another model type or structure, a head with a bias,
    a subclass of nn.Linear or forward hooks on it, or a model already installed. At each forward with labels:
    a `loss_function` other than transformers' `ForCausalLMLoss` (RuntimeError) and `logits_to_keep` ≠ 0
    (ValueError).
    """
    check_installable(model)
    if sink_for is not None and not callable(sink_for):
        raise TypeError(f"sink_for must be a callable weight -> RowSink or None, got {type(sink_for).__name__}")
    if block_rows is not None and (isinstance(block_rows, bool) or not isinstance(block_rows, int) or block_rows < 1):
        raise ValueError(f"block_rows must be a positive int or None, got {block_rows!r}")
    forward = _HeadForward(model, sink_for, block_rows)
    model.forward = forward
    return HeadHandle(forward)
