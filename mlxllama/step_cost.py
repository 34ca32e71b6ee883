"""What one decode step costs, in the two figures that predict a Mac's decode speed from any
backend: the kernels the step launches, and the weight bytes it reads a token.

Launches are counted, not estimated: the primitives of the step's graph as it is evaluated on the
device at hand (MLX's export_to_dot of its outputs), less those that only view their input and run
no kernel. A compiled function's fused element-wise chain counts once, as it launches; on the CPU
the fast operations (rms_norm, rope, attention) count as the primitives of their fallbacks. On a
GPU a profiler trace counts the device's own launches (benchmarks/kernel_trace.py), which a
library kernel may split further.
"""

from __future__ import annotations

import collections
import io
import re

import mlx.core as mx
from mlx.utils import tree_flatten

# Primitives that give a view of their input (or pass it on) and launch nothing; a reshape that
# must copy does launch, but a decode step's do not.
VIEWS = frozenset({"Broadcast", "Depends", "ExpandDims", "Flatten", "Reshape", "Slice", "Split", "Squeeze",
                   "StopGradient", "Transpose", "Unflatten", "View"})


def launches(outputs: list[mx.array]) -> collections.Counter:
    """The primitives, by name, that evaluating `outputs` (not yet evaluated) runs, views left out."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    names = (label.split(" ")[0] for label in re.findall(r'label ="([^"]+)"', dot.getvalue()))
    return collections.Counter(name for name in names if name not in VIEWS)


def weight_bytes_per_step(model) -> int:
    """The bytes of weights one decode step reads (of every row at once): every parameter, but of
    an untied token table only the rows looked up (none counted), and of a mixture's experts only
    the share its router picks for a token."""
    config = model.config
    total = 0
    for name, array in tree_flatten(model.parameters()):
        if name.startswith("token_embd.") and not config.tied_output:
            continue
        share = config.n_experts_used / config.n_experts if "_exps." in name else 1.0
        total += round(array.nbytes * share)
    return total
