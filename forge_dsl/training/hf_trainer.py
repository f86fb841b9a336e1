"""`ForgeTrainer`: Hugging Face's Trainer with `ForgeOptimizer`, its default clipping and accumulation exact.

    trainer = forge_dsl.ForgeTrainer(model=model, args=TrainingArguments(...), train_dataset=data)
    trainer.train()

`TrainingArguments(max_grad_norm=c)` (1.0 by default) becomes `ForgeOptimizer(max_grad_norm=c)` and each
micro-batch's backward `optimizer.backward(loss)` (the norm's pass, then the clipped update); Trainer's own
`clip_grad_norm_` call then returns the total norm, which it logs as `grad_norm`, and scales nothing.
`gradient_accumulation_steps=k` becomes `accumulation_steps=k`. The optimizer is built as Trainer builds
`adamw_torch` (weight decay on the parameters `get_decay_parameter_names` names, none on the others;
`learning_rate`, `adam_beta1`/`adam_beta2` and `adam_epsilon` where the spec has `betas` / `eps`), with
`forge_spec` (default "adamw") and `forge_options` (e.g. `{"state_dtype": "int8"}`, or any spec keyword).
`TrainingArguments.optim` is not read. A `ForgeOptimizer` passed as `optimizers=(optimizer, scheduler)` is used as
it is, after checking that its clipping and accumulation are the arguments'.

Refused before any step: another optimizer, fp16 loss scaling, DeepSpeed or another distributed engine
(accelerate's backward does more than `loss.backward()` there).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import transformers

from ..spec.loading import SpecLike, load_spec
from .optimizer import ForgeOptimizer

__all__ = ["ForgeTrainer"]


class ForgeTrainer(transformers.Trainer):
    """`transformers.Trainer` training with `ForgeOptimizer` (module docstring).

    Args:
        forge_spec: the spec: a built-in name or a `.fopt` path (default "adamw").
        forge_options: more `ForgeOptimizer` keywords (state_dtype, rounding, lm_head_loss, spec keywords ...).
        *args, **kwargs: `transformers.Trainer`'s.
    """

    def __init__(self, *args, forge_spec: SpecLike = "adamw", forge_options: Optional[Mapping[str, Any]] = None,
                 **kwargs) -> None:
        self.forge_spec = forge_spec
        self.forge_options = dict(forge_options or {})
        for name in ("max_grad_norm", "accumulation_steps"):
            if name in self.forge_options:
                raise TypeError(f"forge_options must not set {name}: ForgeTrainer takes it from TrainingArguments "
                                f"({'max_grad_norm' if name == 'max_grad_norm' else 'gradient_accumulation_steps'})")
        super().__init__(*args, **kwargs)

    def _clipping(self) -> Optional[float]:
        norm = self.args.max_grad_norm
        return float(norm) if norm is not None and norm > 0 else None

    def create_optimizer(self, model=None):
        """A `ForgeOptimizer` as Trainer builds `adamw_torch` (module docstring), unless one was given."""
        if self.optimizer is not None:
            return self.optimizer
        model = model if model is not None else self.model
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        keywords = dict(load_spec(self.forge_spec).keyword_defaults())
        hypers: dict[str, Any] = {"lr": self.args.learning_rate}
        if "betas" in keywords:
            hypers["betas"] = (self.args.adam_beta1, self.args.adam_beta2)
        if "eps" in keywords:
            hypers["eps"] = self.args.adam_epsilon
        hypers.update(self.forge_options)
        self.optimizer = ForgeOptimizer(model, self.forge_spec, model_params=[g for g in groups if g["params"]],
                                        max_grad_norm=self._clipping(),
                                        accumulation_steps=self.args.gradient_accumulation_steps, **hypers)
        return self.optimizer

    def _forge_optimizer(self) -> ForgeOptimizer:
        """The `ForgeOptimizer` under accelerate's wrapper, checked against the arguments."""
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        if not isinstance(optimizer, ForgeOptimizer):
            raise TypeError(f"ForgeTrainer trains with a ForgeOptimizer, got {type(optimizer).__name__}: leave "
                            "optimizers= unset (ForgeTrainer builds one) or pass a ForgeOptimizer")
        wanted = (self._clipping(), self.args.gradient_accumulation_steps)
        if (optimizer.max_grad_norm, optimizer.accumulation_steps) != wanted:
            raise ValueError(
                f"the ForgeOptimizer has max_grad_norm={optimizer.max_grad_norm}, accumulation_steps="
                f"{optimizer.accumulation_steps}, but TrainingArguments ask for max_grad_norm={wanted[0]}, "
                f"gradient_accumulation_steps={wanted[1]}: construct it with the arguments' values (None for "
                "max_grad_norm=0), or let ForgeTrainer build it")
        accelerator = self.accelerator
        engine = str(accelerator.distributed_type).rsplit(".", 1)[-1]
        if accelerator.scaler is not None or engine != "NO":
            raise RuntimeError(f"ForgeTrainer runs optimizer.backward(loss) in place of accelerate's backward, which "
                               f"here does more (distributed engine {engine}, fp16 loss scaling: "
                               f"{accelerator.scaler is not None}): train in bf16 without fp16=True, on one process")
        return optimizer

    def training_step(self, model, inputs, *args, **kwargs):
        """Trainer's step, with its backward `optimizer.backward(loss)` (the loss scaled as accelerate scales it)."""
        optimizer = self._forge_optimizer()
        accelerator = self.accelerator

        def backward(loss, **options):
            if options:
                raise TypeError(f"ForgeTrainer's backward takes no options, got {sorted(options)}")
            optimizer.backward(loss / accelerator.gradient_accumulation_steps)

        accelerator.backward = backward
        try:
            return super().training_step(model, inputs, *args, **kwargs)
        finally:
            del accelerator.backward  # the class's own again
