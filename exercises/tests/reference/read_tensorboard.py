#!/usr/bin/env python3
"""Reads a TensorBoard run directory with TensorBoard's own EventAccumulator and prints its
scalars as JSON: {tag: [[step, value], ...]}. Used by exercises/tests/tensorboard.rs."""
import json
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})  # 0: keep every value
acc.Reload()
print(json.dumps({tag: [[e.step, e.value] for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}))
