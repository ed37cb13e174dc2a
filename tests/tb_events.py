"""Read TensorBoard event files back: scalars written either as plain values or as "new style"
scalar tensors (what podmonitor writes, so that TensorBoard shows each tag's description)."""

from __future__ import annotations

import glob
import os

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util


def scalar_series(path: str) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` of one run folder (or event file)."""
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    out: dict[str, list[tuple[int, float]]] = {}
    tags = acc.Tags()
    for tag in tags.get("scalars", []):
        out[tag] = [(e.step, float(e.value)) for e in acc.Scalars(tag)]
    for tag in tags.get("tensors", []):
        if acc.SummaryMetadata(tag).plugin_data.plugin_name != "scalars":
            continue
        out[tag] = [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
    return out


def summary_metadata(path: str, tag: str):
    acc = EventAccumulator(str(path), size_guidance={"tensors": 0})
    acc.Reload()
    return acc.SummaryMetadata(tag)


def all_scalar_series(root: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag under ``root``; the tags of a per-layer run (``.../podmonitor_layers/<layer>``)
    get ``/<layer>`` appended."""
    out: dict[str, list[tuple[int, float]]] = {}
    for path in glob.glob(os.path.join(str(root), "**", "events.out.tfevents.*"), recursive=True):
        folder = os.path.dirname(path)
        layer = ""
        if os.path.basename(os.path.dirname(folder)) == "podmonitor_layers":
            layer = "/" + os.path.basename(folder)
        for tag, series in scalar_series(path).items():
            out.setdefault(tag + layer, []).extend(series)
    return out
