"""A numpy inference engine for GGUF models.

It knows nothing of HTTP: it reads a GGUF file, keeps the weights quantized in
memory, turns text into tokens and tokens into logits, and exposes generation
as an async generator.
"""
