"""The central-difference checks the Python backward tests use."""

import numpy as np


def directional_error(f, gradients, directions, step=1e-5):
    """|<gradients, directions> - f'(0)| / sum |gradient * direction|, where f(t) is the
    definition's loss at the inputs moved by t * directions and f'(0) its central
    difference with `step`."""
    expected = (f(step) - f(-step)) / (2 * step)
    products = [np.asarray(g, np.float64) * d for g, d in zip(gradients, directions)]
    got = sum(float(p.sum()) for p in products)
    magnitude = sum(float(np.abs(p).sum()) for p in products)
    return abs(got - expected) / magnitude


def elementwise_gradient(f, x, step=1e-5):
    """The gradient of f at x (float64) by a central difference along every element of x."""
    gradient = np.zeros(x.shape)
    for at in np.ndindex(x.shape):
        unit = np.zeros(x.shape)
        unit[at] = 1.0
        gradient[at] = (f(x + step * unit) - f(x - step * unit)) / (2 * step)
    return gradient
