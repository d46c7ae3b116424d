//! Every layout a job could train the Transformer with: data × pipeline × tensor parallelism
//! (tensor-parallel shards inside a host), HSDP's shard groups, the ZeRO stage, the
//! micro-batches, the pipeline schedule, activation recomputation and sequence parallelism,
//! only those the exercises accept (the same rules they refuse the others by).
use serde::Serialize;

use crate::models::TransformerConfig;
use crate::parallel::GradientSync;
use crate::pipeline::{Placement, Schedule};
use crate::precision::Precision;

/// One way to lay the job out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Candidate {
    pub dp: usize,
    pub pp: usize,
    pub tp: usize,
    /// HSDP: ZeRO-3 within shard groups of this many replicas (`--shard-group`).
    pub shard_group: Option<usize>,
    /// The data-parallel style (DDP, ZeRO's stages, HSDP). Written as `--zero`'s stage, the
    /// plan's JSON key since before the styles stated their own costs.
    #[serde(rename = "zero", serialize_with = "zero_stage")]
    pub sync: GradientSync,
    pub schedule: Schedule,
    pub virtual_stages: usize,
    /// Micro-batches per replica's batch (`--chunks`).
    pub chunks: usize,
    /// Sequences per micro-batch.
    pub micro_batch: i64,
    pub recompute: bool,
    pub sequence_parallel: bool,
}

impl Candidate {
    pub fn world(&self) -> usize {
        self.dp * self.pp * self.tp
    }

    pub fn placement(&self) -> Placement {
        Placement { devices: self.pp, virtual_stages: self.virtual_stages }
    }

    /// Sequences per replica's batch (`--batch-size`).
    pub fn replica_batch(&self) -> i64 {
        self.micro_batch * self.chunks as i64
    }

    /// Whether each rank holds the whole model: exercise1_nlp's step, the one that shards
    /// parameters (ZeRO-2 and 3, HSDP); stages and shards are exercise3 tp's.
    pub fn whole_model(&self) -> bool {
        self.pp * self.tp == 1
    }

    /// The command that trains with it (with `--nproc-per-node` or a launcher for the ranks).
    pub fn flags(&self) -> String {
        let exercise = if self.whole_model() { "exercise1_nlp" } else { "exercise3 tp" };
        format!("{exercise} {}", self.layout_flags())
    }

    /// Its flags alone (`--tp 2 --batch-size 8 --sequence-parallel`): what `--layout auto`
    /// sets.
    pub fn layout_flags(&self) -> String {
        let mut flags = Vec::new();
        // exercise3 tp fills the ranks left by the flags given with shards: the layout is
        // stated whole (`--tp 1 --pp 2 --dp 2`, not `--pp 2`, which it would run as 2 stages
        // of 2 shards).
        if !self.whole_model() {
            flags.push(format!("--tp {}", self.tp));
            if self.dp > 1 {
                flags.push(format!("--dp {}", self.dp));
            }
        }
        if self.pp > 1 {
            flags.push(format!("--pp {}", self.pp));
        }
        flags.push(format!("--batch-size {}", self.replica_batch()));
        if let Some(stage) = self.sync.zero_stage() {
            flags.push(format!("--zero {}", stage.number()));
        }
        if let Some(group) = self.shard_group {
            flags.push(format!("--shard-group {group}"));
        }
        if self.pp > 1 {
            flags.push(format!("--chunks {} --schedule {}", self.chunks, self.schedule.name()));
            if self.virtual_stages > 1 {
                flags.push(format!("--virtual-stages {}", self.virtual_stages));
            }
        }
        if self.recompute {
            flags.push("--checkpoint-activations".into());
        }
        if self.sequence_parallel {
            flags.push("--sequence-parallel".into());
        }
        flags.join(" ")
    }
}

/// What the layouts are chosen for.
#[derive(Debug, Clone, Copy)]
pub struct Space {
    pub nodes: usize,
    pub gpus_per_node: usize,
    /// Sequences per optimizer step, over all replicas.
    pub global_batch: usize,
    pub model: TransformerConfig,
    pub precision: Precision,
    /// How many hosts are network namespaces or containers of one machine (`make
    /// test-cluster`'s, `make bench-plan HOSTS=2`), 1 for hosts of their own: each such group's
    /// CPU ranks share one machine's cores (the profile's host's), while the links between the
    /// hosts are still the hosts'.
    pub hosts_per_machine: usize,
}

/// A candidate's style as its JSON has it: `--zero`'s stage (null without ZeRO).
fn zero_stage<S: serde::Serializer>(sync: &GradientSync, serializer: S) -> Result<S::Ok, S::Error> {
    sync.zero_stage().serialize(serializer)
}

fn divisors(n: usize) -> impl Iterator<Item = usize> {
    (1..=n).filter(move |d| n.is_multiple_of(*d))
}

/// Every legal layout of `space`, in a fixed order.
pub fn enumerate(space: &Space) -> Vec<Candidate> {
    let world = space.nodes * space.gpus_per_node;
    let mut out = Vec::new();
    // Tensor-parallel shards talk every layer: inside a host, and only where the model divides.
    for tp in divisors(space.gpus_per_node).filter(|&tp| space.model.validate_shards(tp).is_ok()) {
        for pp in divisors(world / tp).filter(|&pp| pp as i64 <= space.model.nlayers) {
            let dp = world / (tp * pp);
            // The 16-bit true precisions run whole models only (their activations between
            // stages and shards are not built).
            if space.precision.weights_kind().is_some() && pp * tp > 1 {
                continue;
            }
            if !space.global_batch.is_multiple_of(dp) {
                continue;
            }
            let batch = space.global_batch / dp;
            for chunks in divisors(batch).filter(|&c| pp > 1 || c == 1) {
                for (schedule, virtual_stages) in schedules(pp, chunks, space.model.nlayers) {
                    for recompute in if pp > 1 { vec![false, true] } else { vec![false] } {
                        for sequence_parallel in if tp > 1 { vec![false, true] } else { vec![false] } {
                            for (sync, shard_group) in sharding(dp, pp * tp) {
                                out.push(Candidate {
                                    dp,
                                    pp,
                                    tp,
                                    shard_group,
                                    sync,
                                    schedule,
                                    virtual_stages,
                                    chunks,
                                    micro_batch: (batch / chunks) as i64,
                                    recompute,
                                    sequence_parallel,
                                });
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// The schedules a pipeline of `pp` stages can run `chunks` micro-batches with: one stage
/// needs none; GPipe and 1F1B always; interleaved with 2 stages per device where the
/// micro-batches are a multiple of the devices and the layers fill the stages.
fn schedules(pp: usize, chunks: usize, nlayers: i64) -> Vec<(Schedule, usize)> {
    if pp == 1 {
        return vec![(Schedule::GPipe, 1)];
    }
    let mut out = vec![(Schedule::GPipe, 1), (Schedule::OneFOneB, 1)];
    let interleaved = Placement { devices: pp, virtual_stages: 2 };
    if interleaved.check(Schedule::Interleaved, chunks).is_ok() && interleaved.check_layers(nlayers).is_ok() {
        out.push((Schedule::Interleaved, 2));
    }
    out
}

/// How `dp` replicas of a model cut over `model_ranks` ranks can shard their state: each
/// style's layouts, as it states them ([`crate::parallel::Costs::shard_groups`]: plain replicas
/// and ZeRO-1 always; ZeRO-2, ZeRO-3 and HSDP for a whole model per rank only, as the exercises
/// accept them).
fn sharding(dp: usize, model_ranks: usize) -> Vec<(GradientSync, Option<usize>)> {
    GradientSync::ALL.into_iter().flat_map(|sync| sync.strategy().shard_groups(dp, model_ranks == 1).into_iter().map(move |group| (sync, group))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn space(nodes: usize, gpus: usize, batch: usize) -> Space {
        let model = TransformerConfig { ntoken: 64, d_model: 32, nhead: 4, d_hid: 64, nlayers: 4, dropout: 0.0 };
        Space { nodes, gpus_per_node: gpus, global_batch: batch, model, precision: Precision::Full, hosts_per_machine: 1 }
    }

    #[test]
    fn every_layout_fills_the_job_and_keeps_the_exercises_rules() {
        let all = enumerate(&space(2, 2, 8));
        assert!(!all.is_empty());
        for c in &all {
            assert_eq!(c.world(), 4, "{c:?}");
            assert!(c.tp <= 2, "shards inside a host: {c:?}");
            assert_eq!(c.dp * c.chunks * c.micro_batch as usize, 8, "the global batch: {c:?}");
            if c.pp * c.tp > 1 {
                assert!([GradientSync::Ddp, GradientSync::zero(1)].contains(&c.sync) && c.shard_group.is_none(), "{c:?}");
            }
            if c.pp == 1 {
                assert_eq!((c.chunks, c.schedule, c.virtual_stages), (1, Schedule::GPipe, 1), "{c:?}");
            }
            if c.schedule == Schedule::Interleaved {
                assert!(c.chunks.is_multiple_of(c.pp) && c.pp * 2 <= 4, "{c:?}");
            }
            assert!(!c.sequence_parallel || c.tp > 1, "{c:?}");
            assert!(c.shard_group.is_none_or(|g| c.dp.is_multiple_of(g) && g > 1 && g < c.dp), "{c:?}");
        }
        // Each kind is there: 4 replicas with HSDP in pairs, 2 stages × 2 shards interleaved.
        assert!(all.iter().any(|c| c.dp == 4 && c.shard_group == Some(2)));
        assert!(all.iter().any(|c| (c.pp, c.tp, c.schedule) == (2, 2, Schedule::Interleaved) && c.sequence_parallel && c.recompute));
        assert!(all.iter().all(|c| !c.recompute || c.pp > 1), "recomputation is a pipeline's (--checkpoint-activations)");
        assert!(all.iter().any(|c| (c.dp, c.pp) == (1, 4) && c.chunks == 8 && c.schedule == Schedule::OneFOneB));
        // No duplicates.
        for (i, a) in all.iter().enumerate() {
            assert!(!all[i + 1..].contains(a), "{a:?} twice");
        }
    }

    #[test]
    fn a_batch_the_replicas_cannot_share_and_true_precisions_with_shards_are_left_out() {
        assert!(enumerate(&space(1, 4, 3)).iter().all(|c| c.dp == 1 || c.dp == 3));
        let bf16 = Space { precision: Precision::BHalfTrue, ..space(1, 4, 8) };
        assert!(enumerate(&bf16).iter().all(|c| c.pp * c.tp == 1));
        // One head cannot be cut: no tensor parallelism.
        let odd = Space { model: TransformerConfig { nhead: 1, ..space(1, 4, 8).model }, ..space(1, 4, 8) };
        assert!(enumerate(&odd).iter().all(|c| c.tp == 1));
    }
}
