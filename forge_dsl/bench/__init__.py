"""The FORGE benchmark suite behind the `forge-bench` command (`python -m forge_dsl.bench`).

    kernel       one linear layer's update: fused kernel vs cuBLAS dW + a step kernel, vs the roofline
    model        a whole training step on Llama-3.1-8B / Qwen3 shapes: peak memory, step time, breakdown
    convergence  loss curves of a small byte-level Llama on Shakespeare: torch AdamW vs FORGE variants

Beside it, the tools run as `python -m forge_dsl.bench.<name>` (anatomy, sweep_tiles, ws_timeline, ncu_probe,
host_overhead, layer_call, first_call, model_profile, offload_in_flight, replot, sm90; each module's docstring
says what it measures), and `device/` holds the shell scripts one GPU-machine call runs. Records go to the
repository's bench/results/.
"""
