"""Meshes, logical-axis sharding rules and multi-host start-up.

Layer (docs/design.md): above ``config``; may import ``config`` and JAX, no other jaxrl package.
"""

from jaxrl.sharding._distributed import (
    allgather_rows,
    allgather_scalar,
    barrier,
    global_batch,
    initialize,
    process_slice,
    to_host,
)
from jaxrl.sharding._mesh import (
    DEFAULT_RULES,
    MESH_AXES,
    LogicalRules,
    MeshConfig,
    batch_sharding,
    logical_sharding,
    make_mesh,
)

__all__ = [
    "DEFAULT_RULES",
    "MESH_AXES",
    "LogicalRules",
    "MeshConfig",
    "allgather_rows",
    "allgather_scalar",
    "barrier",
    "batch_sharding",
    "global_batch",
    "initialize",
    "logical_sharding",
    "make_mesh",
    "process_slice",
    "to_host",
]
