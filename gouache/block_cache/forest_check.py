"""A reuse predictor's forest, checked as its file is read (`ReusePredictor.load`), so that a
damaged or hand-edited file is refused at start, naming the array and the tree, rather than
failing, or deciding from memory it should not read, at a request's first cached block.

The forest is five arrays [trees, nodes]. Node i of a tree goes to `left[i]` when the unit's
feature `feature[i]` is <= `threshold[i]`, else to `right[i]`; a leaf's children are itself and
`reusable[i]` is its P(reusable). Serving walks every tree `depth` levels from its root
(node 0) with numpy gathers, so a walk must stay inside the arrays and end on a leaf within
`depth` levels. scikit-learn numbers a tree's nodes depth first, so a child comes after its
parent: a walk that only moves forward cannot loop. Nodes past a tree's own count are padding
(zeros) that no walk reaches, so only the nodes a walk reaches are held to that.
"""

from __future__ import annotations

import numpy as np

# Bounds on what a file may hold, far past what `gouache profile --reuse` writes (32 trees of
# depth 8: 511 nodes each) and small enough that a decision (a gather per level over every
# tree and unit) stays a fraction of a block's time.
MAX_TREES = 4096
MAX_NODES = 1 << 22  # trees x nodes of the widest tree: 4M nodes, about 100 MB of JSON
MAX_DEPTH = 64

INDEX_ARRAYS = ("feature", "left", "right")
VALUE_ARRAYS = ("threshold", "reusable")


def forest_arrays(data: dict, features: int) -> tuple[dict[str, np.ndarray], int]:
    """(the five arrays, the depth) of a predictor file's JSON `data`, whose units have
    `features` features; a ValueError naming the array (and tree and node) otherwise."""
    arrays = {name: _array(data.get(name), name, name in INDEX_ARRAYS) for name in (*INDEX_ARRAYS, *VALUE_ARRAYS)}
    shape = arrays["feature"].shape
    for name, array in arrays.items():
        if array.shape != shape:
            raise ValueError(f"{name} has {array.shape[0]} trees of {array.shape[1]} nodes, feature "
                             f"{shape[0]} of {shape[1]}: every array holds the same trees")
    _check_range(arrays["feature"], "feature", 0, features - 1, f"a feature index in [0, {features})")
    for name in ("left", "right"):
        _check_range(arrays[name], name, 0, shape[1] - 1, f"a node index in [0, {shape[1]})")
    _check_range(arrays["threshold"], "threshold", -np.inf, np.inf, "a finite number")
    _check_range(arrays["reusable"], "reusable", 0.0, 1.0, "a probability in [0, 1]")
    depth = data.get("depth")
    if not (isinstance(depth, int) and not isinstance(depth, bool) and 0 <= depth <= MAX_DEPTH):
        raise ValueError(f"depth must be an integer in [0, {MAX_DEPTH}], got {str(depth)[:24]}")
    _check_walks(arrays["left"], arrays["right"], depth)
    return arrays, depth


def _array(value, name: str, index: bool) -> np.ndarray:
    """One array [trees, nodes], its shape checked before numpy reads it (a huge file is refused
    without building it); int64 for the index arrays, float64 for the others."""
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_TREES:
        raise ValueError(f"{name} must be a list of 1 to {MAX_TREES} trees")
    if not all(isinstance(tree, list) for tree in value):
        raise ValueError(f"{name} must be a list of trees, each a list of nodes")
    widths = {len(tree) for tree in value}
    if len(widths) != 1 or 0 in widths:
        raise ValueError(f"{name}'s trees must have the same number of nodes, at least one; got {sorted(widths)[:4]}")
    if len(value) * widths.pop() > MAX_NODES:
        raise ValueError(f"{name} holds more than {MAX_NODES} nodes")
    array = np.array(value)
    # numpy reads a string, null, list or 400-digit integer as an object, an integer past int64 as
    # uint64 or float64: none is a node's index or a float64
    if array.ndim != 2 or array.dtype.kind not in ("i" if index else "iuf"):
        raise ValueError(f"{name} must hold only {'64-bit integers' if index else 'numbers (64-bit floats)'}")
    return array.astype(np.int64 if index else np.float64)


def _check_range(array: np.ndarray, name: str, low: float, high: float, what: str) -> None:
    bad = ~((array >= low) & (array <= high) & np.isfinite(array))  # NaN fails every comparison
    if bad.any():
        tree, node = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"tree {tree}: {name}[{node}] must be {what}, got {array[tree, node]}")


def _check_walks(left: np.ndarray, right: np.ndarray, depth: int) -> None:
    """Every walk from a root reaches a leaf within `depth` levels, each step to later nodes:
    the nodes a walk can be at, level by level, every tree at once."""
    trees, nodes = left.shape
    at = np.arange(trees) * nodes  # flat (tree, node) of each node a walk can be at
    flat_left, flat_right = left.ravel() + at.repeat(nodes), right.ravel() + at.repeat(nodes)
    own = np.arange(trees * nodes)
    leaf = (flat_left == own) & (flat_right == own)
    for level in range(depth + 1):
        inner = at[~leaf[at]]
        backward = inner[(flat_left[inner] <= inner) | (flat_right[inner] <= inner)]
        if len(backward):
            tree, node = divmod(int(backward[0]), nodes)
            raise ValueError(f"tree {tree}: node {node}'s children ({left[tree, node]}, {right[tree, node]}) must "
                             "both be itself (a leaf) or both come after it, so that a walk ends")
        if level == depth and len(inner):
            tree, node = divmod(int(inner[0]), nodes)
            raise ValueError(f"tree {tree}: a walk from its root is at node {node}, not a leaf, after depth {depth} "
                             "levels: the depth is less than the tree's")
        at = np.unique(np.concatenate([at[leaf[at]], flat_left[inner], flat_right[inner]]))
