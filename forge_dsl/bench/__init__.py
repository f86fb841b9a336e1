"""The FORGE benchmark suite behind the `forge-bench` command (`python -m forge_dsl.bench`).

    kernel       one linear layer's update: fused kernel vs cuBLAS dW + a step kernel, vs the roofline
    model        a whole training step on Llama-3.1-8B / Qwen3 shapes: peak memory, step time, breakdown
    convergence  loss curves of a small byte-level Llama on Shakespeare: torch AdamW vs FORGE variants
"""
