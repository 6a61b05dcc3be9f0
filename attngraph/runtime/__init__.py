"""The paged runtime: KV pool, ForwardBatch / ForwardContext, the attention op, the ragged
model, the model runner with its decode CUDA graphs, and the HF generate integration."""
