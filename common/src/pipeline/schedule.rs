//! The order in which each stage runs the forward and backward passes of the micro-batches.
//!
//! Both schedules run every micro-batch's forward before its backward on every stage, and the
//! backward passes in micro-batch order, so activations and gradients travel between two
//! neighbouring stages in the same order on both sides: a stage's messages need no tags.
use serde::Serialize;

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
}

impl Schedule {
    pub fn name(self) -> &'static str {
        match self {
            Schedule::GPipe => "gpipe",
            Schedule::OneFOneB => "1f1b",
        }
    }
}

/// One unit of a stage's work: the forward or the backward pass of micro-batch `m`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Op {
    Forward(usize),
    Backward(usize),
}

/// What `stage` (of `stages`) runs for one mini-batch of `chunks` micro-batches, in order.
pub fn stage_ops(schedule: Schedule, stage: usize, stages: usize, chunks: usize) -> Vec<Op> {
    assert!(stage < stages, "stage {stage} of {stages}");
    let forwards = (0..chunks).map(Op::Forward);
    let backwards = (0..chunks).map(Op::Backward);
    match schedule {
        Schedule::GPipe => forwards.chain(backwards).collect(),
        Schedule::OneFOneB => {
            let warmup = (stages - stage - 1).min(chunks);
            let mut ops: Vec<Op> = (0..warmup).map(Op::Forward).collect();
            for m in warmup..chunks {
                ops.push(Op::Forward(m));
                ops.push(Op::Backward(m - warmup));
            }
            ops.extend((chunks - warmup..chunks).map(Op::Backward));
            ops
        }
    }
}

/// The idle share of a fill-drain pipeline with equal stages and no communication cost:
/// `(p − 1) / (m + p − 1)` for `p` stages and `m` micro-batches (GPipe's bubble).
pub fn theoretical_bubble(stages: usize, chunks: usize) -> f64 {
    (stages as f64 - 1.0) / (chunks + stages - 1) as f64
}

/// The most micro-batches whose activations a stage running `ops` holds at once.
pub fn peak_live(ops: &[Op]) -> usize {
    ops.iter()
        .scan(0usize, |live, op| {
            match op {
                Op::Forward(_) => *live += 1,
                Op::Backward(_) => *live -= 1,
            }
            Some(*live)
        })
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use Op::{Backward as B, Forward as F};

    #[test]
    fn gpipe_is_fill_then_drain() {
        assert_eq!(stage_ops(Schedule::GPipe, 0, 2, 3), [F(0), F(1), F(2), B(0), B(1), B(2)]);
    }

    #[test]
    fn one_f_one_b_warms_up_by_the_stages_still_ahead() {
        // 2 stages, 4 micro-batches: stage 0 runs one forward ahead, the last stage none.
        assert_eq!(stage_ops(Schedule::OneFOneB, 0, 2, 4), [F(0), F(1), B(0), F(2), B(1), F(3), B(2), B(3)]);
        assert_eq!(stage_ops(Schedule::OneFOneB, 1, 2, 4), [F(0), B(0), F(1), B(1), F(2), B(2), F(3), B(3)]);
        // Fewer micro-batches than the warm-up: all forwards, then all backwards.
        assert_eq!(stage_ops(Schedule::OneFOneB, 0, 4, 2), [F(0), F(1), B(0), B(1)]);
    }

    #[test]
    fn every_schedule_runs_each_pass_once_forward_first_backwards_in_order() {
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            for stages in 1..=4 {
                for chunks in 1..=9 {
                    for stage in 0..stages {
                        let ops = stage_ops(schedule, stage, stages, chunks);
                        assert_eq!(ops.len(), 2 * chunks);
                        let pos = |op| ops.iter().position(|o| *o == op).expect("every pass runs");
                        for m in 0..chunks {
                            assert!(pos(F(m)) < pos(B(m)), "{schedule:?}: forward {m} before its backward");
                            if m > 0 {
                                assert!(pos(F(m - 1)) < pos(F(m)) && pos(B(m - 1)) < pos(B(m)));
                            }
                        }
                        let live = peak_live(&ops);
                        match schedule {
                            Schedule::GPipe => assert_eq!(live, chunks),
                            Schedule::OneFOneB => assert!(live <= (stages - stage).min(chunks) && live <= stages),
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn bubble_of_two_stages_and_eight_micro_batches_is_one_ninth() {
        assert!((theoretical_bubble(2, 8) - 1.0 / 9.0).abs() < 1e-12);
        assert_eq!(theoretical_bubble(1, 8), 0.0);
    }
}
