"""Training: a trainer that takes the model, loss, data and settings as arguments, and the
process group of a multi-process run."""
