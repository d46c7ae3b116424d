//! The order in which each device runs the forward and backward passes of the micro-batches
//! through its stages.
//!
//! Every schedule is a warm-up of forward passes, then one forward and one backward in turn,
//! then the remaining backward passes; they differ in the warm-up's length and, with
//! interleaving, in the order in which a device visits its stages. Every micro-batch's forward
//! pass through a stage comes before its backward pass. Messages between devices are tagged
//! with the pass they feed ([`super::link`]), so a device need not take them in the order its
//! neighbour sent them (with interleaving it sometimes does not).
use serde::Serialize;

use super::Placement;
use crate::error::usage;

/// The `--schedule` flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
pub enum Schedule {
    /// GPipe's fill-drain: all forwards, then all backwards. Every stage holds the activations
    /// of all micro-batches at once.
    #[value(name = "gpipe")]
    #[serde(rename = "gpipe")]
    GPipe,
    /// One forward, one backward (PipeDream-flush, Megatron's default): after a warm-up of
    /// `stages − stage − 1` forwards, each stage alternates; stage s holds at most
    /// `stages − s` micro-batches of activations, whatever the number of micro-batches.
    #[value(name = "1f1b")]
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM's virtual pipeline stages): each
    /// device holds several stages ([`Placement`]) and runs 1F1B over them, micro-batches in
    /// groups of `devices` per stage; the bubble shrinks by the number of stages per device.
    #[value(name = "interleaved")]
    #[serde(rename = "interleaved")]
    Interleaved,
}

impl Schedule {
    pub fn name(self) -> &'static str {
        match self {
            Schedule::GPipe => "gpipe",
            Schedule::OneFOneB => "1f1b",
            Schedule::Interleaved => "interleaved",
        }
    }
}

/// Which way a pass goes through a stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum Direction {
    Forward,
    Backward,
}

/// One unit of a device's work: the forward or the backward pass of micro-batch `micro_batch`
/// through stage `stage` (the model's stage index: without interleaving, the device's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Op {
    pub direction: Direction,
    pub stage: usize,
    pub micro_batch: usize,
}

impl Op {
    pub fn forward(stage: usize, micro_batch: usize) -> Op {
        Op { direction: Direction::Forward, stage, micro_batch }
    }

    pub fn backward(stage: usize, micro_batch: usize) -> Op {
        Op { direction: Direction::Backward, stage, micro_batch }
    }

    pub fn is_forward(self) -> bool {
        self.direction == Direction::Forward
    }

    /// Its name in a trace: `F3` or `B3` for micro-batch 3, with `@stage` where a device holds
    /// several stages (`F3@2`).
    pub fn label(self, with_stage: bool) -> String {
        let pass = if self.is_forward() { "F" } else { "B" };
        match with_stage {
            true => format!("{pass}{}@{}", self.micro_batch, self.stage),
            false => format!("{pass}{}", self.micro_batch),
        }
    }
}

/// What each schedule allows of a placement (the schedule's rules, kept with the schedules).
impl Placement {
    /// The virtual stages `--virtual-stages` asks for with `schedule`: 2 by default with the
    /// interleaved schedule, 1 with the others (which run one stage per device).
    pub fn virtual_stages(schedule: Schedule, flag: Option<usize>) -> anyhow::Result<usize> {
        match (schedule, flag) {
            (_, Some(0)) => usage("--virtual-stages must be at least 1"),
            (Schedule::Interleaved, flag) => Ok(flag.unwrap_or(2)),
            (_, None | Some(1)) => Ok(1),
            (_, Some(v)) => usage(format!("--virtual-stages {v} needs --schedule interleaved ({} runs one stage per device)", schedule.name())),
        }
    }

    /// Refuses what `schedule` cannot run: several stages per device without interleaving, and
    /// for the interleaved schedule a number of micro-batches that is not a multiple of the
    /// devices (Megatron-LM's rule: the micro-batches go through each device's stages in groups
    /// of `devices`, and a short group would leave the pipeline waiting).
    pub fn check(self, schedule: Schedule, micro_batches: usize) -> anyhow::Result<()> {
        if self.virtual_stages != 1 {
            Placement::virtual_stages(schedule, Some(self.virtual_stages))?;
        }
        if schedule == Schedule::Interleaved && !micro_batches.is_multiple_of(self.devices) {
            return usage(format!(
                "--schedule interleaved needs --chunks to be a multiple of the {} pipeline devices, got {micro_batches} \
                 (the micro-batches go through each device's stages in groups of {})",
                self.devices, self.devices
            ));
        }
        Ok(())
    }
}

/// What `device` of `placement` runs for one mini-batch of `micro_batches` micro-batches, in
/// order. GPipe and 1F1B need one stage per device; the interleaved schedule needs the
/// micro-batches to be a multiple of the devices ([`Placement::check`]).
pub fn device_ops(schedule: Schedule, placement: Placement, device: usize, micro_batches: usize) -> Vec<Op> {
    assert!(device < placement.devices, "device {device} of {}", placement.devices);
    assert!(schedule == Schedule::Interleaved || placement.virtual_stages == 1, "{} runs one stage per device", schedule.name());
    assert!(
        schedule != Schedule::Interleaved || micro_batches.is_multiple_of(placement.devices),
        "interleaving {micro_batches} micro-batches over {} devices",
        placement.devices
    );
    let visits = visiting_order(placement, micro_batches);
    let stage = |virtual_index: usize| virtual_index * placement.devices + device;
    // The k-th forward micro-step visits `visits[k]`; the k-th backward one the same
    // micro-batch through the stages in reverse (Megatron-LM's `get_model_chunk_id`).
    let last = placement.virtual_stages - 1;
    let forward = |k: usize| Op::forward(stage(visits[k].0), visits[k].1);
    let backward = |k: usize| Op::backward(stage(last - visits[k].0), visits[k].1);
    let steps = visits.len();
    let warmup = warmup(schedule, placement, device, micro_batches);
    let mut ops: Vec<Op> = (0..warmup).map(forward).collect();
    for k in warmup..steps {
        ops.push(forward(k));
        ops.push(backward(k - warmup));
    }
    ops.extend((steps - warmup..steps).map(backward));
    ops
}

/// The forward passes alone (evaluation), in the schedule's visiting order: any number of
/// micro-batches (an evaluation batch may be short), the last group then shorter.
pub fn forward_ops(placement: Placement, device: usize, micro_batches: usize) -> Vec<Op> {
    visiting_order(placement, micro_batches).into_iter().map(|(v, m)| Op::forward(v * placement.devices + device, m)).collect()
}

/// The (virtual stage, micro-batch) pairs in the order a device visits them: the micro-batches
/// in groups of `devices`, each group through the device's stages in turn (Megatron-LM's
/// schedule table). With one stage per device: the micro-batches in order.
fn visiting_order(placement: Placement, micro_batches: usize) -> Vec<(usize, usize)> {
    (0..micro_batches)
        .step_by(placement.devices)
        .flat_map(|first| {
            let group = first..(first + placement.devices).min(micro_batches);
            (0..placement.virtual_stages).flat_map(move |v| group.clone().map(move |m| (v, m)))
        })
        .collect()
}

/// The forward passes `device` runs before its first backward pass: all of them (GPipe); the
/// devices still ahead (1F1B); with interleaving, twice those plus one group of micro-batches
/// per further stage, `2(p − d − 1) + (V − 1)·p` (Megatron-LM's), at most all of them.
pub fn warmup(schedule: Schedule, placement: Placement, device: usize, micro_batches: usize) -> usize {
    let (p, v) = (placement.devices, placement.virtual_stages);
    let ahead = p - device - 1;
    let steps = micro_batches * v;
    match schedule {
        Schedule::GPipe => steps,
        Schedule::OneFOneB => ahead,
        Schedule::Interleaved => 2 * ahead + (v - 1) * p,
    }
    .min(steps)
}

/// The most (stage, micro-batch) activations `device` holds at once under `schedule`: its
/// warm-up plus the one forward of the steady state, at most all of them. GPipe: every
/// micro-batch; 1F1B: `p − d`; interleaved: `2(p − d − 1) + (V − 1)·p + 1`, each a stage's
/// (1/V of a device's layers) worth.
pub fn peak_live_bound(schedule: Schedule, placement: Placement, device: usize, micro_batches: usize) -> usize {
    (warmup(schedule, placement, device, micro_batches) + 1).min(micro_batches * placement.virtual_stages)
}

/// The bubble as Narayanan et al. (2021) count it, idle time over compute time, for `devices`
/// devices of equal stages, `micro_batches` micro-batches and `virtual_stages` stages per
/// device, communication free: `(p − 1) / (V·m)` (GPipe's and 1F1B's `(p − 1)/m` at V = 1).
pub fn theoretical_bubble_ratio(devices: usize, micro_batches: usize, virtual_stages: usize) -> f64 {
    (devices as f64 - 1.0) / (virtual_stages * micro_batches) as f64
}

/// The same bubble as a share of the devices' time, what [`super::StepReport::bubble_fraction`]
/// measures: `(p − 1) / (V·m + p − 1)` (GPipe's `(p − 1)/(m + p − 1)` at V = 1).
pub fn theoretical_bubble(devices: usize, micro_batches: usize, virtual_stages: usize) -> f64 {
    let ratio = theoretical_bubble_ratio(devices, micro_batches, virtual_stages);
    ratio / (1.0 + ratio)
}

/// The most micro-batches whose activations a device running `ops` holds at once (a
/// micro-batch's activations of one stage count once).
pub fn peak_live(ops: &[Op]) -> usize {
    ops.iter()
        .scan(0usize, |live, op| {
            match op.direction {
                Direction::Forward => *live += 1,
                Direction::Backward => *live -= 1,
            }
            Some(*live)
        })
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use super::*;

    const F: fn(usize, usize) -> Op = Op::forward;
    const B: fn(usize, usize) -> Op = Op::backward;

    fn one_each(devices: usize) -> Placement {
        Placement::one_stage_each(devices)
    }

    #[test]
    fn gpipe_is_fill_then_drain() {
        assert_eq!(device_ops(Schedule::GPipe, one_each(2), 0, 3), [F(0, 0), F(0, 1), F(0, 2), B(0, 0), B(0, 1), B(0, 2)]);
    }

    #[test]
    fn one_f_one_b_warms_up_by_the_stages_still_ahead() {
        // 2 stages, 4 micro-batches: stage 0 runs one forward ahead, the last stage none.
        let ops = |stage| device_ops(Schedule::OneFOneB, one_each(2), stage, 4);
        assert_eq!(ops(0), [F(0, 0), F(0, 1), B(0, 0), F(0, 2), B(0, 1), F(0, 3), B(0, 2), B(0, 3)]);
        assert_eq!(ops(1), [F(1, 0), B(1, 0), F(1, 1), B(1, 1), F(1, 2), B(1, 2), F(1, 3), B(1, 3)]);
        // Fewer micro-batches than the warm-up: all forwards, then all backwards.
        assert_eq!(device_ops(Schedule::OneFOneB, one_each(4), 0, 2), [F(0, 0), F(0, 1), B(0, 0), B(0, 1)]);
    }

    #[test]
    fn interleaving_visits_groups_of_p_micro_batches_per_stage_as_megatron_does() {
        // 2 devices × 2 virtual stages (device 0: stages 0 and 2; device 1: 1 and 3), 4
        // micro-batches. Device 0 warms up by 2·(2 − 0 − 1) + (2 − 1)·2 = 4 forwards: micro-
        // batches 0, 1 through stage 0, then through stage 2; device 1 by 0 + 2 = 2. Backward
        // passes visit the stages in reverse, micro-batches in the same groups.
        let placement = Placement { devices: 2, virtual_stages: 2 };
        let ops = |device| device_ops(Schedule::Interleaved, placement, device, 4);
        assert_eq!(
            ops(0),
            [F(0, 0), F(0, 1), F(2, 0), F(2, 1), F(0, 2), B(2, 0), F(0, 3), B(2, 1), F(2, 2), B(0, 0), F(2, 3), B(0, 1), B(2, 2), B(2, 3), B(0, 2), B(0, 3),]
        );
        assert_eq!(
            ops(1),
            [F(1, 0), F(1, 1), F(3, 0), B(3, 0), F(3, 1), B(3, 1), F(1, 2), B(1, 0), F(1, 3), B(1, 1), F(3, 2), B(3, 2), F(3, 3), B(3, 3), B(1, 2), B(1, 3),]
        );
        assert_eq!((warmup(Schedule::Interleaved, placement, 0, 4), warmup(Schedule::Interleaved, placement, 1, 4)), (4, 2));
        // Evaluation: the same visiting order, forwards only, any number of micro-batches.
        assert_eq!(forward_ops(placement, 1, 3), [F(1, 0), F(1, 1), F(3, 0), F(3, 1), F(1, 2), F(3, 2)]);
        assert_eq!(forward_ops(one_each(2), 1, 3), [F(1, 0), F(1, 1), F(1, 2)]);
    }

    /// Every layout the tests try: (schedule, placement, micro-batch counts).
    fn layouts() -> Vec<(Schedule, Placement, Vec<usize>)> {
        let mut all = Vec::new();
        for devices in 1..=4 {
            for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
                all.push((schedule, one_each(devices), (1..=9).collect()));
            }
            for virtual_stages in 1..=3 {
                let micro_batches = (1..=4).map(|groups| groups * devices).collect();
                all.push((Schedule::Interleaved, Placement { devices, virtual_stages }, micro_batches));
            }
        }
        all
    }

    #[test]
    fn every_schedule_runs_each_pass_once_forward_first_in_order_within_its_bound() {
        for (schedule, placement, counts) in layouts() {
            for micro_batches in counts {
                for device in 0..placement.devices {
                    let ops = device_ops(schedule, placement, device, micro_batches);
                    let what = format!("{} on device {device} of {placement:?}, {micro_batches} micro-batches", schedule.name());
                    assert_eq!(ops.len(), 2 * micro_batches * placement.virtual_stages, "{what}");
                    let pos = |op| ops.iter().position(|o| *o == op).unwrap_or_else(|| panic!("{what}: {op:?} never runs"));
                    for stage in placement.stages_of(device) {
                        for m in 0..micro_batches {
                            assert!(pos(F(stage, m)) < pos(B(stage, m)), "{what}: forward {m} through stage {stage} before its backward");
                            if m > 0 {
                                // Each stage takes the micro-batches in order, both ways.
                                assert!(pos(F(stage, m - 1)) < pos(F(stage, m)) && pos(B(stage, m - 1)) < pos(B(stage, m)), "{what}");
                            }
                        }
                    }
                    assert_eq!(ops.iter().collect::<HashSet<_>>().len(), ops.len(), "{what}: a pass runs twice");
                    let bound = peak_live_bound(schedule, placement, device, micro_batches);
                    assert_eq!(peak_live(&ops), bound, "{what}: activations held at once");
                    let p = placement.devices;
                    match schedule {
                        Schedule::GPipe => assert_eq!(bound, micro_batches),
                        Schedule::OneFOneB => assert!(bound <= (p - device).min(micro_batches)),
                        Schedule::Interleaved => assert!(bound <= 2 * (p - device - 1) + (placement.virtual_stages - 1) * p + 1),
                    }
                }
            }
        }
    }

    /// Runs every device's passes as the executor does, each pass starting once its device is
    /// free and the tensor it needs has arrived, with forward passes taking `forward` and
    /// backward passes `backward` time units and messages none. Sends never wait (channels,
    /// MPI's `isend`). Returns when the last device finishes, or `None` if the devices would
    /// wait for each other for ever.
    fn simulate(schedule: Schedule, placement: Placement, micro_batches: usize, forward: f64, backward: f64) -> Option<f64> {
        let devices = placement.devices;
        let ops: Vec<Vec<Op>> = (0..devices).map(|d| device_ops(schedule, placement, d, micro_batches)).collect();
        let (mut next, mut free) = (vec![0; devices], vec![0.0f64; devices]);
        let mut finished: HashMap<Op, f64> = HashMap::new();
        loop {
            let mut progressed = false;
            for d in 0..devices {
                while let Some(&op) = ops[d].get(next[d]) {
                    let ready = match feeding_pass(op, placement.stages()) {
                        None => 0.0,
                        Some(source) => match finished.get(&source) {
                            Some(&t) => t,
                            None => break,
                        },
                    };
                    free[d] = free[d].max(ready) + if op.is_forward() { forward } else { backward };
                    finished.insert(op, free[d]);
                    next[d] += 1;
                    progressed = true;
                }
            }
            if (0..devices).all(|d| next[d] == ops[d].len()) {
                return free.into_iter().reduce(f64::max);
            }
            if !progressed {
                return None;
            }
        }
    }

    /// The pass on another stage whose output `op` takes (none for the first stage's forward
    /// and the last stage's backward).
    fn feeding_pass(op: Op, stages: usize) -> Option<Op> {
        match op.direction {
            Direction::Forward => (op.stage > 0).then(|| F(op.stage - 1, op.micro_batch)),
            Direction::Backward => (op.stage + 1 < stages).then(|| B(op.stage + 1, op.micro_batch)),
        }
    }

    /// The pass on another stage that takes `op`'s output (none for the last stage's forward
    /// and the first stage's backward).
    fn fed_pass(op: Op, stages: usize) -> Option<Op> {
        match op.direction {
            Direction::Forward => (op.stage + 1 < stages).then(|| F(op.stage + 1, op.micro_batch)),
            Direction::Backward => (op.stage > 0).then(|| B(op.stage - 1, op.micro_batch)),
        }
    }

    /// Whether every device finishes when sends wait for their receiver as NCCL's do
    /// ([`crate::comm::nccl`]): a device's sends are queued, go out with its next receive, and
    /// that receive returns only once they have been received too.
    fn finishes_with_sends_that_wait_for_the_receiver(schedule: Schedule, placement: Placement, micro_batches: usize) -> bool {
        /// A receive and the sends that went out with it: (peer, index of the message between the two).
        struct Group {
            sends: Vec<(usize, usize)>,
            receive: Option<(usize, usize)>,
        }
        let (devices, stages) = (placement.devices, placement.stages());
        let ops: Vec<Vec<Op>> = (0..devices).map(|d| device_ops(schedule, placement, d, micro_batches)).collect();
        // Per (sender, receiver): the messages sent so far, and how many the receiver asked for.
        let mut sent: HashMap<(usize, usize), Vec<Op>> = HashMap::new();
        let mut asked: HashMap<(usize, usize), usize> = HashMap::new();
        let mut next = vec![0; devices];
        let mut queued: Vec<Vec<(usize, Op)>> = vec![Vec::new(); devices];
        let mut stash: Vec<HashSet<Op>> = vec![HashSet::new(); devices];
        let mut groups: Vec<Option<Group>> = (0..devices).map(|_| None).collect();
        let mut finished = vec![false; devices];
        loop {
            let mut progressed = false;
            for d in 0..devices {
                while !finished[d] {
                    if let Some(group) = &groups[d] {
                        let delivered = group.sends.iter().all(|&(to, i)| asked.get(&(d, to)).copied().unwrap_or(0) > i);
                        let arrived = group.receive.is_none_or(|(from, i)| sent.get(&(from, d)).is_some_and(|m| m.len() > i));
                        if !(delivered && arrived) {
                            break;
                        }
                        if let Some((from, i)) = group.receive {
                            stash[d].insert(sent[&(from, d)][i]);
                        }
                        groups[d] = None;
                        progressed = true;
                        continue;
                    }
                    let op = ops[d].get(next[d]).copied();
                    let source = op.and_then(|op| feeding_pass(op, stages)).filter(|_| !stash[d].contains(&op.unwrap()));
                    if op.is_none() && queued[d].is_empty() {
                        finished[d] = true;
                    } else if op.is_none() || source.is_some() {
                        // Receive (or, at the end, wait for the sends), the queued sends going out with it.
                        let sends = std::mem::take(&mut queued[d])
                            .into_iter()
                            .map(|(to, tag)| {
                                let messages = sent.entry((d, to)).or_default();
                                messages.push(tag);
                                (to, messages.len() - 1)
                            })
                            .collect();
                        let receive = source.map(|source| {
                            let from = placement.device_of(source.stage);
                            let count = asked.entry((from, d)).or_default();
                            *count += 1;
                            (from, *count - 1)
                        });
                        groups[d] = Some(Group { sends, receive });
                    } else {
                        let op = op.unwrap();
                        stash[d].remove(&op);
                        if let Some(fed) = fed_pass(op, stages) {
                            queued[d].push((placement.device_of(fed.stage), fed));
                        }
                        next[d] += 1;
                    }
                    progressed = true;
                }
            }
            if finished.iter().all(|&f| f) {
                return true;
            }
            if !progressed {
                return false;
            }
        }
    }

    #[test]
    fn every_device_receives_from_each_neighbour_in_the_order_it_sent() {
        // One stream of messages per (sender, receiver) pair, as MPI and NCCL keep them (with 2
        // devices interleaved, activations and gradients share it): for every schedule the
        // receiver needs them in the order they were sent, so the executor's stash stays empty
        // (it is there so that the executor does not depend on this).
        for (schedule, placement, counts) in layouts() {
            for micro_batches in counts {
                let stages = placement.stages();
                let mut sent: HashMap<(usize, usize), Vec<Op>> = HashMap::new();
                let mut needed: HashMap<(usize, usize), Vec<Op>> = HashMap::new();
                for device in 0..placement.devices {
                    for op in device_ops(schedule, placement, device, micro_batches) {
                        if let Some(fed) = fed_pass(op, stages) {
                            sent.entry((device, placement.device_of(fed.stage))).or_default().push(fed);
                        }
                        if let Some(source) = feeding_pass(op, stages) {
                            needed.entry((placement.device_of(source.stage), device)).or_default().push(op);
                        }
                    }
                }
                assert_eq!(sent, needed, "{} on {placement:?}, {micro_batches} micro-batches", schedule.name());
            }
        }
    }

    #[test]
    fn interleaving_needs_sends_that_do_not_wait_for_the_receiver() {
        // GPipe and 1F1B finish whether sends wait for their receiver (NCCL) or not (channels,
        // MPI): a stage process may use either. Interleaving finishes only with sends that do
        // not wait (every case above simulates that); with NCCL's, 2 devices × 2 virtual stages
        // already deadlock, device 0 waiting for device 1 to take a forward activation while
        // device 1 waits for device 0 to take a gradient. Stage processes therefore refuse the
        // interleaved schedule over NCCL.
        for (schedule, placement, counts) in layouts() {
            if schedule != Schedule::Interleaved {
                for micro_batches in counts {
                    assert!(finishes_with_sends_that_wait_for_the_receiver(schedule, placement, micro_batches), "{schedule:?} {placement:?} {micro_batches}");
                }
            }
        }
        let interleaved = Placement { devices: 2, virtual_stages: 2 };
        assert!(!finishes_with_sends_that_wait_for_the_receiver(Schedule::Interleaved, interleaved, 4));
    }

    #[test]
    fn every_schedule_finishes_and_idles_as_the_theory_says() {
        // Equal stages, a backward pass twice a forward (or as long), no communication cost:
        // the devices' idle share is exactly (p − 1)/(V·m + p − 1), for all three schedules.
        for (schedule, placement, counts) in layouts() {
            for micro_batches in counts {
                for (forward, backward) in [(1.0, 1.0), (1.0, 2.0)] {
                    let what = format!("{} on {placement:?}, {micro_batches} micro-batches", schedule.name());
                    let makespan = simulate(schedule, placement, micro_batches, forward, backward).unwrap_or_else(|| panic!("{what}: deadlock"));
                    let busy = (micro_batches * placement.virtual_stages) as f64 * (forward + backward);
                    let idle = 1.0 - busy / makespan;
                    let theory = theoretical_bubble(placement.devices, micro_batches, placement.virtual_stages);
                    assert!((idle - theory).abs() < 1e-12, "{what}: idle share {idle} vs theory {theory}");
                }
            }
        }
    }

    #[test]
    fn the_bubble_shrinks_by_the_virtual_stages() {
        assert!((theoretical_bubble(2, 8, 1) - 1.0 / 9.0).abs() < 1e-12);
        assert_eq!(theoretical_bubble(1, 8, 1), 0.0);
        assert!((theoretical_bubble_ratio(4, 8, 1) - 3.0 / 8.0).abs() < 1e-12);
        assert!((theoretical_bubble_ratio(4, 8, 2) - 3.0 / 16.0).abs() < 1e-12, "(p − 1)/(V·m)");
        assert!((theoretical_bubble(2, 4, 2) - 1.0 / 9.0).abs() < 1e-12, "(p − 1)/(V·m + p − 1)");
    }
}
