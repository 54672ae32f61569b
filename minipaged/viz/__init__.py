"""minipaged.viz: seeing paging and continuous batching, step by step.

Every picture is drawn from recorded data, an ``EngineTrace`` (``minipaged.trace``),
or for block tables also from a live ``minipaged.core.KVCacheManager``; each has a text
rendering that prints the same state deterministically (terminals, nbval).

===========================  =======================================================
``timeline(trace)``          a row per request, a column per step: waiting, prefill
                             (chunk size), decode, preempted, swapped; batch strips
``timelines({title: trace})`` several runs' timelines side by side, one step axis
``block_tables(src, step)``  logical blocks -> physical block grid, ref counts, free
``step(trace, i)``           both side by side: the lecture's picture
``memory(trace)``            KV slots over time: holding tokens, reserved, free
``*_text(...)``              the same as strings
``stepper(trace)``           an ipywidgets player over ``step(trace, i)``
``packed_batch(inp, ids, bs)`` one step as the model reads it: the flat ragged batch of a
                             ``ModelInput`` (tokens, positions, slots, block tables)
``beam_tables(trace, steps)`` beam search: block tables at several steps, every beam
                             under a stable name and colour, forks as children
===========================  =======================================================

Figures come from pyplot (``managed=True``, the default) so that in a notebook
``fig = timeline(trace); plt.show(); plt.close(fig)`` shows them once; ``managed=False``
returns a Figure pyplot never sees (files, widgets). matplotlib is imported only when a
figure is drawn; the text renderings do not need it.
"""

from minipaged.viz.activity import timeline, timeline_cells, timeline_text, timelines
from minipaged.viz.batch import packed_batch, packed_batch_text
from minipaged.viz.beams import beam_lineage, beam_tables, beam_tables_text
from minipaged.viz.blocks import block_tables, block_tables_text
from minipaged.viz.occupancy import memory, memory_series, memory_text
from minipaged.viz.snapshot import BlockSnapshot, request_order, snapshot
from minipaged.viz.stepview import step, step_text


def stepper(trace, **kwargs):
    """An ipywidgets stepper over ``step(trace, i)``; see ``minipaged.viz.widgets``."""
    from minipaged.viz.widgets import stepper as _stepper

    return _stepper(trace, **kwargs)


__all__ = [
    "BlockSnapshot",
    "beam_lineage",
    "beam_tables",
    "beam_tables_text",
    "block_tables",
    "block_tables_text",
    "memory",
    "memory_series",
    "memory_text",
    "packed_batch",
    "packed_batch_text",
    "request_order",
    "snapshot",
    "step",
    "step_text",
    "stepper",
    "timeline",
    "timeline_cells",
    "timeline_text",
    "timelines",
]
