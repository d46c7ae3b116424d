//! One mini-batch of a pipeline on the clock: every device runs its schedule's operations
//! ([`schedule::device_ops`], the same lists the executor runs) in order, each as soon as the
//! device is free and its input has arrived (a forward pass waits for the previous stage's
//! forward of the same micro-batch, a backward pass for the next stage's backward, plus the
//! transfer between devices). The bubble is what this timeline leaves idle, not a formula: it
//! covers every schedule, unequal stages and the transfers.
use std::collections::HashMap;

use crate::pipeline::schedule::{self, Direction, Op};
use crate::pipeline::{Placement, Schedule};

/// Seconds of each stage's passes of one micro-batch, and of a transfer between two devices.
#[derive(Debug, Clone)]
pub struct StageCosts {
    /// Forward seconds of each stage (by the model's stage index).
    pub forward: Vec<f64>,
    /// Backward seconds of each stage (with recomputation: its forward again included).
    pub backward: Vec<f64>,
    /// One activation (or its gradient) from a device to the next.
    pub transfer: f64,
}

/// What the timeline of one mini-batch comes to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timeline {
    /// From the first forward pass to the last backward pass on any device.
    pub seconds: f64,
    /// The busiest device's compute.
    pub busiest: f64,
    /// The busiest device's idle time within `seconds` (the bubble and waits for transfers).
    pub idle: f64,
}

/// Runs `micro_batches` through `placement`'s devices as `schedule` orders them.
///
/// # Panics
/// Where the costs do not cover the placement's stages, or the schedule cannot run it
/// ([`Placement::check`] refuses those first).
pub fn simulate(schedule: Schedule, placement: Placement, micro_batches: usize, costs: &StageCosts) -> Timeline {
    let stages = placement.stages();
    assert!(costs.forward.len() == stages && costs.backward.len() == stages, "costs for {stages} stages");
    let ops: Vec<Vec<Op>> = (0..placement.devices).map(|d| schedule::device_ops(schedule, placement, d, micro_batches)).collect();
    let mut next = vec![0usize; placement.devices];
    let mut free = vec![0.0f64; placement.devices];
    let mut busy = vec![0.0f64; placement.devices];
    let mut done: HashMap<Op, f64> = HashMap::new();
    let total: usize = ops.iter().map(Vec::len).sum();
    while done.len() < total {
        let mut progressed = false;
        for device in 0..placement.devices {
            // Run this device's next operations for as long as their inputs are there.
            while let Some(&op) = ops[device].get(next[device]) {
                let Some(ready) = input_ready(op, stages, placement, costs, &done) else { break };
                let cost = match op.direction {
                    Direction::Forward => costs.forward[op.stage],
                    Direction::Backward => costs.backward[op.stage],
                };
                let start = free[device].max(ready);
                free[device] = start + cost;
                busy[device] += cost;
                done.insert(op, free[device]);
                next[device] += 1;
                progressed = true;
            }
        }
        assert!(progressed, "the schedule's operations wait on each other: {} of {total} done", done.len());
    }
    let seconds = free.iter().copied().fold(0.0, f64::max);
    let busiest = busy.iter().copied().fold(0.0, f64::max);
    Timeline { seconds, busiest, idle: seconds - busiest }
}

/// When `op`'s input is on its device: at once for the first stage's forward and the last
/// stage's backward (after its own forward), else when the neighbouring stage's pass is done
/// plus a transfer where that stage is on another device. None while it is not done.
fn input_ready(op: Op, stages: usize, placement: Placement, costs: &StageCosts, done: &HashMap<Op, f64>) -> Option<f64> {
    let from = match op.direction {
        Direction::Forward if op.stage == 0 => return Some(0.0),
        Direction::Forward => Op::forward(op.stage - 1, op.micro_batch),
        Direction::Backward if op.stage + 1 == stages => Op::forward(op.stage, op.micro_batch),
        Direction::Backward => Op::backward(op.stage + 1, op.micro_batch),
    };
    let finished = *done.get(&from)?;
    let moved = placement.device_of(from.stage) != placement.device_of(op.stage);
    Some(finished + if moved { costs.transfer } else { 0.0 })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::schedule::theoretical_bubble;

    fn equal(stages: usize, forward: f64, backward: f64, transfer: f64) -> StageCosts {
        StageCosts { forward: vec![forward; stages], backward: vec![backward; stages], transfer }
    }

    #[test]
    fn one_stage_runs_its_micro_batches_back_to_back() {
        let t = simulate(Schedule::GPipe, Placement::one_stage_each(1), 5, &equal(1, 1.0, 2.0, 9.0));
        assert_eq!((t.seconds, t.busiest, t.idle), (15.0, 15.0, 0.0));
    }

    /// Equal stages and free transfers: the textbook figure, (m + p − 1)(F + B) for GPipe and
    /// 1F1B alike, and the bubble share (p − 1)/(V·m + p − 1) the schedule module states.
    #[test]
    fn equal_stages_give_the_textbook_bubble_for_every_schedule() {
        for (schedule, virtual_stages) in [(Schedule::GPipe, 1), (Schedule::OneFOneB, 1), (Schedule::Interleaved, 2)] {
            for (devices, m) in [(2, 4), (4, 8), (4, 4)] {
                let placement = Placement { devices, virtual_stages };
                let stages = placement.stages();
                // The model's work split over more stages: each 1/V of a device's.
                let (f, b) = (1.0 / virtual_stages as f64, 2.0 / virtual_stages as f64);
                let t = simulate(schedule, placement, m, &equal(stages, f, b, 0.0));
                let work = m as f64 * 3.0;
                assert!((t.busiest - work).abs() < 1e-9, "{schedule:?} {devices}×{m}: {t:?}");
                let bubble = theoretical_bubble(devices, m, virtual_stages);
                assert!((t.idle / t.seconds - bubble).abs() < 1e-9, "{schedule:?} on {devices} devices, {m} micro-batches: {t:?}, the formula {bubble}");
            }
        }
    }

    #[test]
    fn the_slowest_stage_and_the_transfers_set_the_pace() {
        // Two stages, the second twice as slow: after the first micro-batch fills the pipe, the
        // slow stage works without pause; every transfer delays the start and the turn.
        let costs = StageCosts { forward: vec![1.0, 2.0], backward: vec![2.0, 4.0], transfer: 0.5 };
        let t = simulate(Schedule::GPipe, Placement::one_stage_each(2), 4, &costs);
        // Stage 1: forwards start at 1.5 and run back to back (4 × 2), then its 4 backwards (4 × 4);
        // stage 0's last backward waits for stage 1's last (transfer) and takes 2.
        assert!((t.seconds - (1.5 + 8.0 + 16.0 + 0.5 + 2.0)).abs() < 1e-9, "{t:?}");
        assert!((t.busiest - 24.0).abs() < 1e-9);
    }
}
