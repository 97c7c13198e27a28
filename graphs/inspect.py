"""Reading a captured graph's nodes with cuda-python (``cuda.bindings``).

``graph_nodes(graph)`` lists kernels (with their names), memsets, copies
(with their direction), host nodes and the rest, child graphs included.
``assert_graph_safe(graph)`` fails on host nodes and on copies between host
and device: a replay that runs host code or moves data to or from the host
either synchronises or reads values frozen at capture.

Graphs must keep their ``cudaGraph_t``: ``torch.cuda.CUDAGraph(keep_graph=True)``
(what :func:`make_graphed_callables` and :func:`capture_step` create).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence, Union

HOST_SIDE_COPIES = ("HtoD", "DtoH", "HtoH")


class GraphSafetyError(RuntimeError):
    """A captured graph holds nodes that break replay-without-the-host."""


@dataclass(frozen=True)
class GraphNode:
    """One node of a captured graph.

    Attributes:
        index: position in :func:`graph_nodes`' list (depth-first through child graphs).
        type: ``kernel``, ``memcpy``, ``memset``, ``host``, ``graph`` (child),
            ``empty``, ``wait_event``, ``event_record``, ``mem_alloc``,
            ``mem_free``, ``conditional`` or ``other``.
        name: the kernel's name (kernels only).
        copy: ``HtoD``, ``DtoH``, ``DtoD`` or ``HtoH`` (copies only).
        depth: 0 for the top-level graph, 1 inside a child graph, ...
        dependencies: indices of the nodes this one waits for (same graph).
    """

    index: int
    type: str
    name: Optional[str] = None
    copy: Optional[str] = None
    depth: int = 0
    dependencies: tuple[int, ...] = field(default_factory=tuple)

    def describe(self) -> str:
        detail = self.name or self.copy or ""
        return f"#{self.index} {self.type}" + (f" {detail}" if detail else "")


def _bindings():
    try:
        from cuda.bindings import driver, runtime
    except ImportError as error:  # pragma: no cover - depends on the install
        raise RuntimeError(
            "graph inspection needs cuda-python's cuda.bindings (pip install cuda-python)"
        ) from error
    return runtime, driver


def _check(result):
    """Unpacks a cuda.bindings result tuple, raising on an error code."""
    error, *values = result
    if int(error) != 0:
        raise RuntimeError(f"CUDA call failed: {error!r}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def raw_graph_handle(graph) -> int:
    """The ``cudaGraph_t`` of ``graph`` (a CUDAGraph, a graphed callable's graph or an int)."""
    if isinstance(graph, int) and not isinstance(graph, bool):
        return graph
    raw = getattr(graph, "raw_cuda_graph", None)
    if raw is None:
        raise TypeError(
            f"expected a torch.cuda.CUDAGraph (or a raw cudaGraph_t as int), got {type(graph).__name__}"
        )
    try:
        return int(raw())
    except RuntimeError as error:
        raise RuntimeError(
            "this CUDA graph did not keep its cudaGraph_t; capture it with "
            "torch.cuda.CUDAGraph(keep_graph=True) (as graphs.make_graphed_callables does) to inspect it"
        ) from error


_TYPE_NAMES = {
    "cudaGraphNodeTypeKernel": "kernel",
    "cudaGraphNodeTypeMemcpy": "memcpy",
    "cudaGraphNodeTypeMemset": "memset",
    "cudaGraphNodeTypeHost": "host",
    "cudaGraphNodeTypeGraph": "graph",
    "cudaGraphNodeTypeEmpty": "empty",
    "cudaGraphNodeTypeWaitEvent": "wait_event",
    "cudaGraphNodeTypeEventRecord": "event_record",
    "cudaGraphNodeTypeExtSemaphoreSignal": "other",
    "cudaGraphNodeTypeExtSemaphoreWait": "other",
    "cudaGraphNodeTypeMemAlloc": "mem_alloc",
    "cudaGraphNodeTypeMemFree": "mem_free",
    "cudaGraphNodeTypeConditional": "conditional",
}


def _type_name(runtime, node_type) -> str:
    name = getattr(node_type, "name", str(node_type)).split(".")[-1]
    return _TYPE_NAMES.get(name, "other")


def classify_copy(src_on_host: bool, dst_on_host: bool) -> str:
    """``HtoD``, ``DtoH``, ``DtoD`` or ``HtoH`` from where each side lives."""
    return ("H" if src_on_host else "D") + "to" + ("H" if dst_on_host else "D")


_KIND_NAMES = {
    "cudaMemcpyHostToHost": "HtoH",
    "cudaMemcpyHostToDevice": "HtoD",
    "cudaMemcpyDeviceToHost": "DtoH",
    "cudaMemcpyDeviceToDevice": "DtoD",
}


def _on_host(runtime, pointer: int) -> bool:
    """Whether ``pointer`` addresses host memory (pinned, pageable or managed-on-host)."""
    if not pointer:
        return False
    attributes = _check(runtime.cudaPointerGetAttributes(pointer))
    kind = getattr(attributes.type, "name", str(attributes.type))
    return not kind.endswith(("Device", "Managed"))


def _copy_direction(runtime, node) -> str:
    params = _check(runtime.cudaGraphMemcpyNodeGetParams(node))
    kind = getattr(params.kind, "name", str(params.kind)).split(".")[-1]
    if kind in _KIND_NAMES:
        return _KIND_NAMES[kind]
    # cudaMemcpyDefault: ask where each pointer lives.
    src = int(params.srcPtr.ptr) if params.srcArray is None or not int(params.srcArray) else 0
    dst = int(params.dstPtr.ptr) if params.dstArray is None or not int(params.dstArray) else 0
    return classify_copy(_on_host(runtime, src), _on_host(runtime, dst))


def _kernel_name(runtime, driver, node) -> Optional[str]:
    """The kernel's name via its CUfunction, its CUkernel, or the runtime's function handle."""
    error, params = driver.cuGraphKernelNodeGetParams(driver.CUgraphNode(init_value=int(node)))
    if int(error) == 0:
        if int(params.func):
            error, name = driver.cuFuncGetName(driver.CUfunction(init_value=int(params.func)))
            if int(error) == 0:
                return _text(name)
        kernel = getattr(params, "kern", None)
        if kernel is not None and int(kernel) and hasattr(driver, "cuKernelGetName"):
            error, name = driver.cuKernelGetName(driver.CUkernel(init_value=int(kernel)))
            if int(error) == 0:
                return _text(name)
    error, params = runtime.cudaGraphKernelNodeGetParams(node)
    if int(error) == 0 and params.func and hasattr(runtime, "cudaFuncGetName"):
        error, name = runtime.cudaFuncGetName(params.func)
        if int(error) == 0:
            return _text(name)
    return None


def _text(name) -> str:
    return name.decode() if isinstance(name, bytes) else str(name)


def _edges(runtime, raw) -> list[tuple[int, int]]:
    result = runtime.cudaGraphGetEdges(raw, 0)
    count = _check(result)[-1]
    if not count:
        return []
    values = _check(runtime.cudaGraphGetEdges(raw, count))
    sources, targets = values[0], values[1]
    return [(int(a), int(b)) for a, b in zip(sources, targets)]


def graph_nodes(graph) -> list[GraphNode]:
    """The nodes of a captured graph, depth-first through child graphs."""
    runtime, driver = _bindings()
    nodes: list[GraphNode] = []
    _walk(runtime, driver, runtime.cudaGraph_t(init_value=raw_graph_handle(graph)), 0, nodes)
    return nodes


def _walk(runtime, driver, raw, depth: int, out: list[GraphNode]) -> None:
    count = _check(runtime.cudaGraphGetNodes(raw, 0))[-1]
    if not count:
        return
    handles = _check(runtime.cudaGraphGetNodes(raw, count))[0]
    base = len(out)
    index_of = {int(handle): base + i for i, handle in enumerate(handles)}
    depends: dict[int, list[int]] = {}
    for source, target in _edges(runtime, raw):
        if source in index_of and target in index_of:
            depends.setdefault(index_of[target], []).append(index_of[source])
    children = []
    for i, handle in enumerate(handles):
        kind = _type_name(runtime, _check(runtime.cudaGraphNodeGetType(handle)))
        name = _kernel_name(runtime, driver, handle) if kind == "kernel" else None
        copy = _copy_direction(runtime, handle) if kind == "memcpy" else None
        out.append(GraphNode(base + i, kind, name, copy, depth, tuple(depends.get(base + i, ()))))
        if kind == "graph":
            children.append(_check(runtime.cudaGraphChildGraphNodeGetGraph(handle)))
    for child in children:
        _walk(runtime, driver, child, depth + 1, out)


def unsafe_nodes(nodes: Iterable[GraphNode]) -> list[GraphNode]:
    """Host nodes and copies with a host side."""
    return [n for n in nodes if n.type == "host" or (n.type == "memcpy" and n.copy in HOST_SIDE_COPIES)]


def assert_graph_safe(graph: Union[object, Sequence[GraphNode]]) -> list[GraphNode]:
    """Raises :class:`GraphSafetyError` if the graph has host nodes or host copies.

    ``graph`` is a captured graph (see :func:`graph_nodes`) or a node list.
    Returns the node list when the graph is safe.
    """
    nodes = list(graph) if isinstance(graph, (list, tuple)) else graph_nodes(graph)
    bad = unsafe_nodes(nodes)
    if bad:
        listed = "; ".join(n.describe() for n in bad[:10]) + (f"; and {len(bad) - 10} more" if len(bad) > 10 else "")
        raise GraphSafetyError(
            f"the graph has {len(bad)} node(s) that involve the host ({listed}) among {len(nodes)} nodes. "
            "A host node runs Python/C callbacks at every replay and a host<->device copy moves "
            "values frozen at capture (or forces a synchronisation); keep such work outside the "
            "captured region and pass data as device tensors."
        )
    return nodes


def summary(nodes: Sequence[GraphNode]) -> dict[str, int]:
    """Node counts by type (copies by direction): ``{'kernel': 12, 'memcpy DtoD': 2, ...}``."""
    counts: dict[str, int] = {}
    for node in nodes:
        key = node.type if node.copy is None else f"{node.type} {node.copy}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def to_dot(nodes: Sequence[GraphNode], title: str = "graph") -> str:
    """A Graphviz DOT text of a node list (edges from ``dependencies``)."""
    lines = [f'digraph "{title}" {{', "  node [shape=box, fontsize=10];"]
    for node in nodes:
        label = node.describe().replace('"', "'")
        if len(label) > 80:
            label = label[:77] + "..."
        style = ', style=filled, fillcolor="#f4cccc"' if node in unsafe_nodes([node]) else ""
        lines.append(f'  n{node.index} [label="{label}"{style}];')
    for node in nodes:
        for dependency in node.dependencies:
            lines.append(f"  n{dependency} -> n{node.index};")
    lines.append("}")
    return "\n".join(lines) + "\n"


__all__ = [
    "GraphNode",
    "GraphSafetyError",
    "graph_nodes",
    "assert_graph_safe",
    "unsafe_nodes",
    "summary",
    "to_dot",
    "classify_copy",
    "raw_graph_handle",
]
