"""What a reader copies from: a model of one's own for ``meshplan train --model`` and
factories for models written without meshplan (Hugging Face, Equinox, plain JAX).

Nothing in the library or the command line imports this package."""
