"""Training: losses, optimizers, the train state, jitted steps and the loop.
Knows nothing of where data comes from."""
