"""The model layer we own (issue 53): the Llama family as llm_api's code, run by the engine on a kernel set.

- ``families``: which loaded models run as ours (``own_model``) and the path each takes (``ModelPath``);
- ``kernel_choice``: the kernel set a model runs on (the C set on a CPU, Triton's on CUDA, else torch's);
- ``llama``: one decoder with a few flags (q/k norms, sliding windows, biases) over the loaded modules;
- ``linear``: the linear kinds (plain, quantized, LoRA-wrapped, packed) and merged products;
- ``whole_layers``: a layer, or a step's every layer, as calls of a set that runs whole layers (the C set).

Every other family keeps transformers' classes with the paged attention function (``llm_api.engine.attention``).
"""
