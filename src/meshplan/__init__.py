"""meshplan: lay Flax models out on device meshes.

The logical-axis SPMD partitioning system of Flax's SPMD utilities, with the
same names and signatures (switch by changing an import), plus the tools to
see, check and search partition plans. Flax Linen boxes and Flax NNX states
(``nnx.state``, ``nnx.split``) are both accepted wherever a tree is.
"""

from meshplan._checkpoint.checkpointer import Checkpointer
from meshplan._checkpoint.metadata import CheckpointMetadata
from meshplan._checkpoint.restore import Restored, restore
from meshplan._errors import (
    ArgumentError,
    CheckpointError,
    LogicalNamesError,
    MeshError,
    MeshplanError,
    PartitioningUnspecifiedError,
    Problem,
    RulesError,
    ShardingValidationError,
    UnmatchedLogicalAxisError,
)
from meshplan._plan.check import check
from meshplan._plan.explain import explain
from meshplan._plan.plan import Plan
from meshplan._search.predict.infer import InferredNames, NameClass, infer_names
from meshplan._search.predict.prediction import Prediction, predict
from meshplan._search.predict.profiles import HardwareProfile, get_profile, load_profile
from meshplan._search.predict.trace import Workload, trace_workload
from meshplan._search.search.layout_search import SearchResult, search_layouts
from meshplan._search.search.options import SearchChecks, SearchHardware, SearchSpace
from meshplan._search.search.rule_search import RuleSearchResult, search_rules
from meshplan._spmd.boxes import (
    PARTITION_NAME,
    LogicallyPartitioned,
    Partitioned,
    replace_boxed,
    unbox,
    with_logical_partitioning,
    with_partitioning,
)
from meshplan._spmd.by_path import UnnamedLeavesWarning, name_by_path
from meshplan._spmd.constraints import (
    RulesFallback,
    explicit_out_sharding,
    logical_dot_general,
    with_logical_constraint,
)
from meshplan._spmd.nnx import nnx_sharding, with_nnx_partitioning
from meshplan._spmd.pipeline import PipelineSchedule, pipeline_layers
from meshplan._spmd.place import UnevenShardWarning, active_mesh
from meshplan._spmd.rules import (
    get_logical_axis_rules,
    logical_axis_rules,
    logical_to_mesh_axes,
    set_logical_axis_rules,
)
from meshplan._spmd.shardings import (
    get_partition_spec,
    get_sharding,
    logical_to_mesh,
    logical_to_mesh_sharding,
)
from meshplan._spmd.validate import validate
from meshplan._version import __version__ as __version__

__all__ = [
    "PARTITION_NAME",
    "ArgumentError",
    "CheckpointError",
    "CheckpointMetadata",
    "Checkpointer",
    "HardwareProfile",
    "InferredNames",
    "LogicalNamesError",
    "LogicallyPartitioned",
    "MeshError",
    "MeshplanError",
    "NameClass",
    "Partitioned",
    "PartitioningUnspecifiedError",
    "PipelineSchedule",
    "Plan",
    "Prediction",
    "Problem",
    "Restored",
    "RuleSearchResult",
    "RulesError",
    "RulesFallback",
    "SearchChecks",
    "SearchHardware",
    "SearchResult",
    "SearchSpace",
    "ShardingValidationError",
    "UnevenShardWarning",
    "UnmatchedLogicalAxisError",
    "UnnamedLeavesWarning",
    "Workload",
    "active_mesh",
    "check",
    "explain",
    "explicit_out_sharding",
    "get_logical_axis_rules",
    "get_partition_spec",
    "get_profile",
    "get_sharding",
    "infer_names",
    "load_profile",
    "logical_axis_rules",
    "logical_dot_general",
    "logical_to_mesh",
    "logical_to_mesh_axes",
    "logical_to_mesh_sharding",
    "name_by_path",
    "nnx_sharding",
    "pipeline_layers",
    "predict",
    "replace_boxed",
    "restore",
    "search_layouts",
    "search_rules",
    "set_logical_axis_rules",
    "trace_workload",
    "unbox",
    "validate",
    "with_logical_constraint",
    "with_logical_partitioning",
    "with_nnx_partitioning",
    "with_partitioning",
]

# Public classes report the public path, so tracebacks and docs print ``meshplan.MeshError``.
for _name in __all__:
    _obj = globals()[_name]
    if isinstance(_obj, type):
        _obj.__module__ = __name__
del _name, _obj
