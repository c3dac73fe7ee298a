"""What the command line runs: the built-in models (a Transformer in Linen and NNX, an MLP,
Llama sizes), their registry, the byte corpus, the decoder and the guide's workflow.

``meshplan.examples`` holds what a reader copies from; nothing here imports it."""
