//! One mini-batch of a pipeline on the clock: every device runs its schedule's operations
//! ([`schedule::device_ops`], the same lists the executor runs) in order, each as soon as the
//! device is free and its input has arrived (a forward pass waits for the previous stage's
//! forward of the same micro-batch, a backward pass for the next stage's backward, plus the
//! transfer between devices). The bubble is what this timeline leaves idle, not a formula: it
//! covers every schedule, unequal stages and the transfers.
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
    /// Seconds each stage's forward and backward pass waits for its tensor-parallel partners
    /// while its host's cores are as crowded as [`Sharing::crowding`] measures in full: a shard
    /// that reaches a collective while a partner is off its core waits for the partner's turn.
    pub forward_waits: Vec<f64>,
    pub backward_waits: Vec<f64>,
}

impl StageCosts {
    /// Passes that never wait for partners (no shards, or cores enough for every rank).
    pub fn new(forward: Vec<f64>, backward: Vec<f64>, transfer: f64) -> StageCosts {
        let stages = forward.len();
        StageCosts { forward, backward, transfer, forward_waits: vec![0.0; stages], backward_waits: vec![0.0; stages] }
    }
}

/// How the ranks that run the devices' operations share their hosts' cores: CPU ranks on a
/// host with fewer cores than they use run slower while more of them compute, and faster while
/// others idle in the bubble. GPUs, one per rank, share nothing ([`Sharing::none`]).
pub struct Sharing<'a> {
    /// For each host, how many of its ranks run each device's operations (every replica's and
    /// shard's ranks of that pipeline device).
    pub ranks: Vec<Vec<f64>>,
    /// How much slower than alone a rank runs while this many ranks of its host compute.
    pub slowdown: &'a dyn Fn(f64) -> f64,
    /// What share of a pass's waits for its partners ([`StageCosts::forward_waits`]) it pays
    /// while this many ranks of its host compute: 0 while they have a core each.
    pub crowding: &'a dyn Fn(f64) -> f64,
}

impl Sharing<'_> {
    pub fn none() -> Sharing<'static> {
        Sharing { ranks: Vec::new(), slowdown: &|_| 1.0, crowding: &|_| 0.0 }
    }

    /// Each host's busy ranks while `running` devices compute.
    fn busy(&self, running: &[bool]) -> Vec<f64> {
        self.ranks.iter().map(|host| host.iter().zip(running).filter(|(_, &r)| r).map(|(n, _)| n).sum()).collect()
    }

    /// Each device's speed (1: as alone) while `running` devices compute.
    fn speeds(&self, running: &[bool]) -> Vec<f64> {
        let mut speed = vec![1.0f64; running.len()];
        for (host, busy) in self.ranks.iter().zip(self.busy(running)) {
            let on_host = 1.0 / (self.slowdown)(busy).max(1.0);
            for (device, n) in host.iter().enumerate() {
                if *n > 0.0 {
                    speed[device] = speed[device].min(on_host);
                }
            }
        }
        speed
    }

    /// The share of its waits for partners that `device`'s pass pays while `running` devices
    /// compute: the most crowded of the hosts its ranks are on.
    fn crowded(&self, running: &[bool], device: usize) -> f64 {
        self.ranks.iter().zip(self.busy(running)).filter(|(host, _)| host[device] > 0.0).map(|(_, busy)| (self.crowding)(busy)).fold(0.0, f64::max)
    }
}

/// What the timeline of one mini-batch comes to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timeline {
    /// From the first forward pass to the last backward pass on any device.
    pub seconds: f64,
    /// The busiest device's time computing.
    pub busiest: f64,
    /// The busiest device's idle time within `seconds` (the bubble and waits for transfers).
    pub idle: f64,
    /// The most any device waited for its tensor-parallel partners on crowded cores (within
    /// its busy time).
    pub partner_waits: f64,
}

/// Runs `micro_batches` through `placement`'s devices as `schedule` orders them, the costs
/// being each pass's seconds alone, the devices sharing cores as `sharing` says. Event by
/// event: an operation starts as soon as its device is free and its input has arrived, and
/// runs at the speed its host's busy ranks leave it until the next start or end.
///
/// # Panics
/// Where the costs do not cover the placement's stages, or the schedule cannot run it
/// ([`Placement::check`] refuses those first).
pub fn simulate(schedule: Schedule, placement: Placement, micro_batches: usize, costs: &StageCosts, sharing: &Sharing) -> Timeline {
    simulate_varied(schedule, placement, micro_batches, costs, sharing, &mut |_| 1.0)
}

/// [`simulate`] with each operation's cost multiplied by `vary(op)`, drawn as the operation
/// starts: passes of uneven length, as a machine's variability makes them
/// ([`super::variability`]).
pub fn simulate_varied(
    schedule: Schedule,
    placement: Placement,
    micro_batches: usize,
    costs: &StageCosts,
    sharing: &Sharing,
    vary: &mut dyn FnMut(Op) -> f64,
) -> Timeline {
    let stages = placement.stages();
    let devices = placement.devices;
    assert!(costs.forward.len() == stages && costs.backward.len() == stages, "costs for {stages} stages");
    let ops: Vec<Vec<Op>> = (0..devices).map(|d| schedule::device_ops(schedule, placement, d, micro_batches)).collect();
    let total: usize = ops.iter().map(Vec::len).sum();
    let mut next = vec![0usize; devices];
    // Each device's operation in progress and its seconds of work left (at speed 1).
    let mut running: Vec<Option<(Op, f64)>> = vec![None; devices];
    let mut busy = vec![0.0f64; devices];
    let mut waited = vec![0.0f64; devices];
    let mut done = Done::new(stages, micro_batches);
    let mut now = 0.0f64;
    while done.count < total {
        // Start what can start now; note when the rest's inputs arrive.
        let mut arrival = f64::INFINITY;
        let mut started = Vec::new();
        for device in 0..devices {
            if running[device].is_some() {
                continue;
            }
            let Some(&op) = ops[device].get(next[device]) else { continue };
            let Some(ready) = input_ready(op, stages, placement, costs, &done) else { continue };
            if ready <= now {
                let cost = vary(op)
                    * match op.direction {
                        Direction::Forward => costs.forward[op.stage],
                        Direction::Backward => costs.backward[op.stage],
                    };
                running[device] = Some((op, cost));
                next[device] += 1;
                started.push(device);
            } else {
                arrival = arrival.min(ready);
            }
        }
        let computing: Vec<bool> = running.iter().map(Option::is_some).collect();
        let speed = sharing.speeds(&computing);
        // What the passes just started wait for their partners, as crowded as the cores are
        // now that every device that could start has: wall seconds, in work at its speed.
        for device in started {
            let Some((op, left)) = running[device] else { continue };
            let waits = match op.direction {
                Direction::Forward => &costs.forward_waits,
                Direction::Backward => &costs.backward_waits,
            };
            let wait = waits[op.stage] * sharing.crowded(&computing, device);
            waited[device] += wait;
            running[device] = Some((op, left + wait * speed[device]));
        }
        let finish: Vec<f64> = (0..devices).map(|d| running[d].map_or(f64::INFINITY, |(_, left)| left / speed[d])).collect();
        let step = finish.iter().copied().fold(arrival - now, f64::min);
        assert!(step.is_finite(), "the schedule's operations wait on each other: {} of {total} done", done.count);
        for device in 0..devices {
            let Some((op, left)) = running[device] else { continue };
            busy[device] += step;
            if finish[device] <= step {
                done.insert(op, now + step);
                running[device] = None;
            } else {
                running[device] = Some((op, left - step * speed[device]));
            }
        }
        now += step;
    }
    let busiest = busy.iter().copied().fold(0.0, f64::max);
    Timeline { seconds: now, busiest, idle: now - busiest, partner_waits: waited.iter().copied().fold(0.0, f64::max) }
}

/// When each operation ended, by direction, stage and micro-batch (a table: the plan runs the
/// timeline many times per layout, and a hash map's lookups were most of its time).
struct Done {
    ended: Vec<Option<f64>>,
    stages: usize,
    micro_batches: usize,
    count: usize,
}

impl Done {
    fn new(stages: usize, micro_batches: usize) -> Done {
        Done { ended: vec![None; 2 * stages * micro_batches], stages, micro_batches, count: 0 }
    }

    fn index(&self, op: Op) -> usize {
        let direction = match op.direction {
            Direction::Forward => 0,
            Direction::Backward => 1,
        };
        (direction * self.stages + op.stage) * self.micro_batches + op.micro_batch
    }

    fn get(&self, op: Op) -> Option<f64> {
        self.ended[self.index(op)]
    }

    fn insert(&mut self, op: Op, at: f64) {
        let i = self.index(op);
        if self.ended[i].replace(at).is_none() {
            self.count += 1;
        }
    }
}

/// When `op`'s input is on its device: at once for the first stage's forward and the last
/// stage's backward (after its own forward), else when the neighbouring stage's pass is done
/// plus a transfer where that stage is on another device. None while it is not done.
fn input_ready(op: Op, stages: usize, placement: Placement, costs: &StageCosts, done: &Done) -> Option<f64> {
    let from = match op.direction {
        Direction::Forward => match op.stage.checked_sub(1) {
            Some(previous) => Op::forward(previous, op.micro_batch),
            None => return Some(0.0),
        },
        Direction::Backward if op.stage + 1 == stages => Op::forward(op.stage, op.micro_batch),
        Direction::Backward => Op::backward(op.stage + 1, op.micro_batch),
    };
    let finished = done.get(from)?;
    let moved = placement.device_of(from.stage) != placement.device_of(op.stage);
    Some(finished + if moved { costs.transfer } else { 0.0 })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::schedule::theoretical_bubble;

    fn equal(stages: usize, forward: f64, backward: f64, transfer: f64) -> StageCosts {
        StageCosts::new(vec![forward; stages], vec![backward; stages], transfer)
    }

    #[test]
    fn one_stage_runs_its_micro_batches_back_to_back() {
        let t = simulate(Schedule::GPipe, Placement::one_stage_each(1), 5, &equal(1, 1.0, 2.0, 9.0), &Sharing::none());
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
                let t = simulate(schedule, placement, m, &equal(stages, f, b, 0.0), &Sharing::none());
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
        let costs = StageCosts::new(vec![1.0, 2.0], vec![2.0, 4.0], 0.5);
        let t = simulate(Schedule::GPipe, Placement::one_stage_each(2), 4, &costs, &Sharing::none());
        // Stage 1: forwards start at 1.5 and run back to back (4 × 2), then its 4 backwards (4 × 4);
        // stage 0's last backward waits for stage 1's last (transfer) and takes 2.
        assert!((t.seconds - (1.5 + 8.0 + 16.0 + 0.5 + 2.0)).abs() < 1e-9, "{t:?}");
        assert!((t.busiest - 24.0).abs() < 1e-9);
    }

    /// Two stages whose ranks share one host's cores: on one core the step is the work of both,
    /// back to back whatever the schedule (the bubble hands the core to the busy stage); on
    /// two, each stage has its own and the bubble is GPipe's.
    #[test]
    fn stages_that_share_cores_give_each_other_the_bubble() {
        let costs = equal(2, 1.0, 2.0, 0.0);
        let ranks = vec![vec![1.0, 1.0]];
        for (cores, seconds) in [(1.0, 12.0), (2.0, 9.0)] {
            let slowdown = move |busy: f64| busy / cores;
            let sharing = Sharing { ranks: ranks.clone(), slowdown: &slowdown, crowding: &|_| 0.0 };
            for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
                let t = simulate(schedule, Placement::one_stage_each(2), 2, &costs, &sharing);
                assert!((t.seconds - seconds).abs() < 1e-9, "{schedule:?} on {cores} core(s): {t:?}");
            }
        }
        // Ranks on other hosts do not slow these: each host counts its own.
        let slowdown = |busy: f64| busy;
        let apart = Sharing { ranks: vec![vec![1.0, 0.0], vec![0.0, 1.0]], slowdown: &slowdown, crowding: &|_| 0.0 };
        let t = simulate(Schedule::GPipe, Placement::one_stage_each(2), 2, &costs, &apart);
        assert!((t.seconds - 9.0).abs() < 1e-9, "{t:?}");
    }

    /// Shards wait for their partners only while their host's ranks outnumber its cores: 4
    /// ranks of one stage on 2 cores compute at half speed and pay each pass's wait in full; 2
    /// ranks pay none; two stages of 2 pay it only while both compute (GPipe over one
    /// micro-batch: never).
    #[test]
    fn shards_wait_for_their_partners_only_on_crowded_cores() {
        let slowdown = |busy: f64| (busy / 2.0).max(1.0);
        let crowding = |busy: f64| ((busy - 2.0) / 2.0).max(0.0);
        let on = |ranks: Vec<f64>| Sharing { ranks: vec![ranks], slowdown: &slowdown, crowding: &crowding };
        let waiting = |stages| StageCosts { forward_waits: vec![0.25; stages], backward_waits: vec![0.5; stages], ..equal(stages, 1.0, 2.0, 0.0) };
        // Two micro-batches: 2 × 3 s of work at half speed, and 2 × 0.75 s of waits.
        let crowded = simulate(Schedule::GPipe, Placement::one_stage_each(1), 2, &waiting(1), &on(vec![4.0]));
        assert!((crowded.seconds - 13.5).abs() < 1e-9 && (crowded.partner_waits - 1.5).abs() < 1e-9, "{crowded:?}");
        let roomy = simulate(Schedule::GPipe, Placement::one_stage_each(1), 2, &waiting(1), &on(vec![2.0]));
        assert!((roomy.seconds - 6.0).abs() < 1e-9 && roomy.partner_waits == 0.0, "{roomy:?}");
        let apart = simulate(Schedule::GPipe, Placement::one_stage_each(2), 1, &waiting(2), &on(vec![2.0, 2.0]));
        assert!((apart.seconds - 6.0).abs() < 1e-9 && apart.partner_waits == 0.0, "{apart:?}");
        // Over 4 micro-batches the stages overlap, and the waits come back.
        let overlapping = simulate(Schedule::OneFOneB, Placement::one_stage_each(2), 4, &waiting(2), &on(vec![2.0, 2.0]));
        let free = simulate(Schedule::OneFOneB, Placement::one_stage_each(2), 4, &equal(2, 1.0, 2.0, 0.0), &on(vec![2.0, 2.0]));
        assert!(overlapping.partner_waits > 0.0 && overlapping.seconds > free.seconds, "{overlapping:?} against {free:?}");
    }
}
