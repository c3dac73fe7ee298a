"""meshplan: lay Flax models out on device meshes.

The logical-axis SPMD partitioning system of Flax's SPMD utilities, with the
same names and signatures (switch by changing an import), plus the tools to
see, check and search partition plans.
"""

from meshplan._boxes import (
    PARTITION_NAME,
    LogicallyPartitioned,
    Partitioned,
    replace_boxed,
    unbox,
    with_logical_partitioning,
    with_partitioning,
)
from meshplan._check import check
from meshplan._check_problems import Problem
from meshplan._checkpoint import Checkpointer
from meshplan._checkpoint_metadata import CheckpointMetadata
from meshplan._checkpoint_restore import Restored, restore
from meshplan._constraints import RulesFallback, explicit_out_sharding, with_logical_constraint
from meshplan._errors import (
    ArgumentError,
    CheckpointError,
    LogicalNamesError,
    MeshError,
    MeshplanError,
    PartitioningUnspecifiedError,
    RulesError,
    ShardingValidationError,
    UnmatchedLogicalAxisError,
)
from meshplan._mesh import active_mesh
from meshplan._plan import explain
from meshplan._plan_object import Plan
from meshplan._rules import (
    get_logical_axis_rules,
    logical_axis_rules,
    logical_to_mesh_axes,
    set_logical_axis_rules,
)
from meshplan._search import SearchResult, search_layouts
from meshplan._shardings import (
    get_partition_spec,
    get_sharding,
    logical_to_mesh,
    logical_to_mesh_sharding,
)

__version__ = "0.1.0"

__all__ = [
    "PARTITION_NAME",
    "ArgumentError",
    "CheckpointError",
    "CheckpointMetadata",
    "Checkpointer",
    "LogicalNamesError",
    "LogicallyPartitioned",
    "MeshError",
    "MeshplanError",
    "Partitioned",
    "PartitioningUnspecifiedError",
    "Plan",
    "Problem",
    "Restored",
    "RulesError",
    "RulesFallback",
    "SearchResult",
    "ShardingValidationError",
    "UnmatchedLogicalAxisError",
    "active_mesh",
    "check",
    "explain",
    "explicit_out_sharding",
    "get_logical_axis_rules",
    "get_partition_spec",
    "get_sharding",
    "logical_axis_rules",
    "logical_to_mesh",
    "logical_to_mesh_axes",
    "logical_to_mesh_sharding",
    "replace_boxed",
    "restore",
    "search_layouts",
    "set_logical_axis_rules",
    "unbox",
    "with_logical_constraint",
    "with_logical_partitioning",
    "with_partitioning",
]
