"""Training with FORGE: the optimizer, what it installs on a model, and the paths that update weights in backward.

    optimizer       ForgeOptimizer (a torch.optim.Optimizer)
    captured        capturable=True's refusals; CapturedStep: the whole step in one CUDA graph
    installer       fuse(model); which weights are fused; installing and removing their forwards
    weight          one fused weight's handle, the forward installed on its module, the step they go through
    stepper         how the optimizer steps a parameter: state, seed, kernel calls
    linear          a fused nn.Linear (autograd.Function, and torch.compile's custom ops)
    embedding       a fused nn.Embedding (the gradient a tile of rows at a time)
    head_loss       a causal LM's loss without logits, the head updated a vocabulary block at a time
    hf_head         that loss installed on Hugging Face causal LMs
    row_updates     where gradients that come in blocks of rows go (RowSink)
    consumed_grad   the `.grad` of a fused weight after its update
    grad_passes     global-norm clipping and gradient accumulation of fused weights
    hf_trainer      ForgeTrainer: Hugging Face's Trainer with ForgeOptimizer (imports transformers)
    tensor_parallel DTensor-sharded models
    data_parallel   FSDP2: each shard updated in backward as its reduced gradient lands
    offload         OffloadActivations: saved activations in pinned host memory
    checkpoint      what a state dict holds beyond torch's, and its checks
"""
