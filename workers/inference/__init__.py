"""The inference server: a small policy served with continuous batching and PipelineRL's in-flight weight
updates (``kiln rl serve``), the trainer's side of the weight transfer, and adapters for SGLang and vLLM."""
