"""Random task graphs for the planners' property tests (hypothesis strategies)."""

from __future__ import annotations

from hypothesis import strategies as st

from gpuprims.coexec.graph import CPU, GPU, Task, TaskGraph


@st.composite
def task_graphs(draw: st.DrawFn, max_tasks: int = 8) -> TaskGraph:
    n = draw(st.integers(1, max_tasks))
    tasks = []
    lat = st.floats(0.01, 20.0, allow_nan=False)
    for i in range(n):
        deps = draw(st.lists(st.integers(0, i - 1), max_size=3, unique=True)) if i else []
        tasks.append(Task(f"t{i}", {GPU: draw(lat), CPU: draw(lat)}, tuple(f"t{d}" for d in deps),
                          out_mb=draw(st.floats(0.0, 30.0)), mem_mb=draw(st.floats(0.0, 50.0))))
    return TaskGraph(tuple(tasks))
