//! How a job's ranks divide the work: `dp` data-parallel replicas of a model cut into `pp`
//! pipeline stages of `tp` tensor-parallel shards, `dp · pp · tp` ranks in all (torchtitan's
//! `ParallelDims`). [`Layout`] is checked once against the world; [`Groups`] then hands out the
//! process groups each kind of parallelism talks over, split from the world once.
//!
//! Ranks are numbered with the tensor-parallel index fastest, then the stage, then the
//! replica: `rank = (replica · pp + stage) · tp + shard`. Launchers number the ranks of a node
//! consecutively, so the shards of a layer stay inside a node (their all-reduces are the most
//! frequent and the largest), the stages of a replica come next (point-to-point activations),
//! and the replicas across nodes (one gradient all-reduce per step).
//!
//! The replicas may themselves be grouped (HSDP, torchtitan's `dp_shard × dp_replicate`):
//! `dp_shard` consecutive replicas form a *shard group* (a node, when the model fits one rank),
//! and the replicas at the same place of every shard group a *replicate group*. A strategy
//! shards the model state within the first and keeps the copies equal across the second.
use anyhow::Result;
use serde::Serialize;

use super::ProcessGroup;
use crate::error::usage;

/// The sizes of the three kinds of parallelism.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Layout {
    /// Data-parallel replicas: each trains on its share of every batch; gradients averaged.
    pub dp: usize,
    /// Pipeline stages: consecutive layers per rank; activations passed along.
    pub pp: usize,
    /// Tensor-parallel shards of every layer (Megatron's), on neighbouring ranks.
    pub tp: usize,
    /// Replicas per shard group (1: the replicas are not grouped; `dp`: one group of all).
    pub dp_shard: usize,
}

/// Where one rank sits in a [`Layout`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Coords {
    pub replica: usize,
    pub stage: usize,
    pub shard: usize,
}

impl Layout {
    /// One rank doing everything.
    pub const SINGLE: Layout = Layout { dp: 1, pp: 1, tp: 1, dp_shard: 1 };

    /// The layout of `world` ranks with `pp` stages of `tp` shards; `dp`, when given, must be
    /// what is left (`world / (pp · tp)`), else it is that.
    pub fn new(world: usize, pp: usize, tp: usize, dp: Option<usize>) -> Result<Layout> {
        if pp == 0 || tp == 0 || dp == Some(0) {
            return usage("--dp, the stages and the tensor-parallel shards must each be at least 1");
        }
        let model = pp * tp;
        if !world.is_multiple_of(model) {
            return usage(match tp {
                1 => format!("{world} ranks cannot run pipelines of {pp} stages: the number of ranks must be stages × --dp"),
                _ => format!(
                    "{world} ranks cannot hold replicas of {pp} stage(s) × {tp} tensor-parallel shards: the number of ranks must be stages × shards × --dp"
                ),
            });
        }
        let replicas = world / model;
        if let Some(dp) = dp.filter(|&dp| dp != replicas) {
            let parts = if tp > 1 { format!("{pp} stage(s) × {tp} shards") } else { format!("{pp} stages") };
            return usage(format!("--dp {dp} with {parts} needs {} ranks, but the job has {world}", dp * model));
        }
        Ok(Layout { dp: replicas, pp, tp, dp_shard: 1 })
    }

    /// This layout with its replicas in shard groups of `size` (`--shard-group`), which must
    /// divide them; none leaves them ungrouped.
    pub fn with_shard_group(self, size: Option<usize>) -> Result<Layout> {
        let Some(size) = size else { return Ok(self) };
        if size < 2 || !self.dp.is_multiple_of(size) {
            return usage(format!(
                "--shard-group {size}: shard groups of at least 2 replicas that divide the job's {} replica(s) (of {} ranks)",
                self.dp,
                self.world_size()
            ));
        }
        Ok(Layout { dp_shard: size, ..self })
    }

    /// The replicas a sharding strategy divides the model state over (ZeRO's N): a shard
    /// group's, or all of them.
    pub fn state_shards(&self) -> usize {
        if self.dp_shard > 1 {
            self.dp_shard
        } else {
            self.dp
        }
    }

    /// The shard groups the replicas form (1 where they are not grouped).
    pub fn dp_replicate(&self) -> usize {
        self.dp / self.dp_shard
    }

    pub fn world_size(&self) -> usize {
        self.dp * self.pp * self.tp
    }

    /// Where `rank` sits.
    pub fn coords(&self, rank: usize) -> Coords {
        Coords { shard: rank % self.tp, stage: (rank / self.tp) % self.pp, replica: rank / (self.tp * self.pp) }
    }

    /// The rank at `coords`.
    pub fn rank(&self, coords: Coords) -> usize {
        (coords.replica * self.pp + coords.stage) * self.tp + coords.shard
    }

    /// One line for logs, e.g. `2 replicas × 2 stages (4 ranks)`.
    pub fn describe(&self) -> String {
        let mut parts = vec![format!("{} replica(s)", self.dp)];
        if self.pp > 1 {
            parts.push(format!("{} stages", self.pp));
        }
        if self.tp > 1 {
            parts.push(format!("{} tensor-parallel shards", self.tp));
        }
        if self.dp_shard > 1 {
            parts[0] = format!("{} replica(s) in {} shard group(s) of {}", self.dp, self.dp_replicate(), self.dp_shard);
        }
        format!("{} ({} ranks)", parts.join(" × "), self.world_size())
    }
}

/// A rank's two groups of replicas when they are grouped ([`Layout::dp_shard`]).
#[derive(Clone, Copy)]
pub struct ShardGroups<'g> {
    /// The replicas of this rank's shard group, in order (the model state is sharded over them).
    pub shard: &'g ProcessGroup,
    /// The replicas at this rank's place in every shard group, in group order (they hold the
    /// same shard).
    pub replicate: &'g ProcessGroup,
}

/// The process groups of a [`Layout`], for this rank: made once, by every rank at the same point
/// (splitting is a collective), each one a world of one where its dimension is 1 and the world
/// itself where its dimension spans it (so a plain data-parallel job, or a plain pipeline,
/// needs no sub-communicators: those need an MPI launcher).
pub struct Groups<'w> {
    pub world: &'w ProcessGroup,
    pub layout: Layout,
    pub coords: Coords,
    /// The replicas holding the same part of the model (gradients are averaged over them).
    dp: Option<ProcessGroup>,
    /// The stages of this rank's replica, in order (activations flow along it).
    pp: Option<ProcessGroup>,
    /// The tensor-parallel shards of this rank's layers (Megatron's f and g all-reduce over it).
    tp: Option<ProcessGroup>,
    /// All ranks holding a part of this rank's replica (stages × shards): the gradient norm and
    /// the scaler's inf/NaN verdict are agreed over them.
    model: Option<ProcessGroup>,
    /// The replicas of this rank's shard group, and those at its place in the other shard
    /// groups ([`Layout::dp_shard`]; both or neither).
    dp_shard: Option<ProcessGroup>,
    dp_replicate: Option<ProcessGroup>,
    /// Links outside the mesh whose traffic this rank's counts include (a parameter-server
    /// worker's to its servers).
    traffic: Option<std::rc::Rc<dyn super::group::Traffic + 'w>>,
}

impl<'w> Groups<'w> {
    /// These groups, counting `traffic` (a strategy's own links) with their own.
    pub fn with_traffic(mut self, traffic: Option<std::rc::Rc<dyn super::group::Traffic + 'w>>) -> Groups<'w> {
        self.traffic = traffic;
        self
    }

    /// Splits `world` for `layout` (which must cover it exactly).
    pub fn new(world: &'w ProcessGroup, layout: Layout) -> Result<Groups<'w>> {
        if layout.world_size() != world.world_size() {
            return usage(format!("a layout of {} for a job of {} ranks", layout.describe(), world.world_size()));
        }
        let coords = layout.coords(world.rank());
        let model_index = coords.stage * layout.tp + coords.shard;
        // Each group: None = this rank alone, Some = a split; the world itself is used as is.
        let make = |size: usize, color: usize, key: usize| -> Result<Option<ProcessGroup>> {
            match size {
                1 => Ok(None),
                n if n == world.world_size() => Ok(None),
                _ => Ok(Some(world.split(color, key)?)),
            }
        };
        // The same splits in the same order on every rank.
        let dp = make(layout.dp, model_index, coords.replica)?;
        let pp = make(layout.pp, coords.replica * layout.tp + coords.shard, coords.stage)?;
        let tp = make(layout.tp, coords.replica * layout.pp + coords.stage, coords.shard)?;
        let model = make(layout.pp * layout.tp, coords.replica, model_index)?;
        // Shard groups only where they are proper subsets of the replicas (a group of all is `dp`).
        let (dp_shard, dp_replicate) = match layout.dp_shard {
            1 => (None, None),
            size if size == layout.dp => (None, None),
            size => {
                let (group, place) = (coords.replica / size, coords.replica % size);
                let models = layout.pp * layout.tp;
                (Some(world.split(group * models + model_index, place)?), Some(world.split(place * models + model_index, group)?))
            }
        };
        Ok(Groups { world, layout, coords, dp, pp, tp, model, dp_shard, dp_replicate, traffic: None })
    }

    /// The groups of a job of one rank.
    pub fn single(world: &'w ProcessGroup) -> Groups<'w> {
        let coords = Coords { replica: 0, stage: 0, shard: 0 };
        Groups { world, layout: Layout::SINGLE, coords, dp: None, pp: None, tp: None, model: None, dp_shard: None, dp_replicate: None, traffic: None }
    }

    /// The group whose dimension has `size` ranks: a split, the world, or this rank alone.
    fn pick<'a>(&'a self, group: &'a Option<ProcessGroup>, size: usize) -> Option<&'a ProcessGroup> {
        match (group, size) {
            (Some(group), _) => Some(group),
            (None, 1) => None,
            (None, _) => Some(self.world),
        }
    }

    /// The data-parallel replicas of this rank's part of the model (None: no replicas).
    pub fn dp(&self) -> Option<&ProcessGroup> {
        self.pick(&self.dp, self.layout.dp)
    }

    /// This replica's pipeline stages (None: one stage).
    pub fn pp(&self) -> Option<&ProcessGroup> {
        self.pick(&self.pp, self.layout.pp)
    }

    /// The ranks that hold parts of this rank's replica (None: this rank holds all of it).
    pub fn model(&self) -> Option<&ProcessGroup> {
        self.pick(&self.model, self.layout.pp * self.layout.tp)
    }

    /// The tensor-parallel shards of this rank's layers, in shard order (None: whole layers).
    pub fn tp(&self) -> Option<&ProcessGroup> {
        self.pick(&self.tp, self.layout.tp)
    }

    /// This rank's shard group and its replicate group, where the replicas are grouped in more
    /// than one shard group of more than one ([`Layout::dp_shard`]).
    pub fn shard_groups(&self) -> Option<ShardGroups<'_>> {
        Some(ShardGroups { shard: self.dp_shard.as_ref()?, replicate: self.dp_replicate.as_ref()? })
    }

    /// This rank's tensor-parallel shard of every layer.
    pub fn shard(&self) -> crate::comm::tensor_parallel::Shard {
        crate::comm::tensor_parallel::Shard { index: self.coords.shard, count: self.layout.tp }
    }

    /// What this rank's groups moved so far (the world's and each split's, counted once), and
    /// its [`Self::with_traffic`] links'.
    pub fn comm_stats(&self) -> super::group::CommStats {
        let servers = self.traffic.as_ref().map(|link| link.comm_stats()).unwrap_or_default();
        self.comm_stats_by_group().into_iter().fold(servers, |sum, (_, stats)| sum.plus(stats))
    }

    /// What each of this rank's groups moved so far, by the mesh's name for it (`world` for
    /// whatever ran over the whole job, a dimension that spans it included).
    pub fn comm_stats_by_group(&self) -> Vec<(&'static str, super::group::CommStats)> {
        let splits =
            [("dp", &self.dp), ("pp", &self.pp), ("tp", &self.tp), ("model", &self.model), ("dp_shard", &self.dp_shard), ("dp_replicate", &self.dp_replicate)];
        std::iter::once(("world", self.world.comm_stats()))
            .chain(splits.into_iter().filter_map(|(name, group)| Some((name, group.as_ref()?.comm_stats()))))
            .collect()
    }

    /// Whether this rank prints, writes results and checkpoints (the world's rank 0).
    pub fn is_root(&self) -> bool {
        self.world.is_root()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_are_shard_fastest_then_stage_then_replica() {
        let layout = Layout::new(8, 2, 2, None).unwrap();
        assert_eq!(layout, Layout { dp: 2, pp: 2, tp: 2, dp_shard: 1 });
        assert_eq!(layout.coords(0), Coords { replica: 0, stage: 0, shard: 0 });
        assert_eq!(layout.coords(1), Coords { replica: 0, stage: 0, shard: 1 });
        assert_eq!(layout.coords(2), Coords { replica: 0, stage: 1, shard: 0 });
        assert_eq!(layout.coords(5), Coords { replica: 1, stage: 0, shard: 1 });
        for rank in 0..8 {
            assert_eq!(layout.rank(layout.coords(rank)), rank);
        }
        // The pipeline's placement so far: rank r runs stage r mod stages of replica r div stages.
        let pipeline = Layout::new(6, 2, 1, Some(3)).unwrap();
        assert_eq!(pipeline.coords(5), Coords { replica: 2, stage: 1, shard: 0 });
    }

    #[test]
    fn a_world_that_does_not_divide_is_refused_clearly() {
        let err = Layout::new(3, 2, 1, None).unwrap_err();
        assert!(format!("{err}").contains("3 ranks cannot run pipelines of 2 stages"), "{err}");
        let err = Layout::new(4, 2, 1, Some(3)).unwrap_err();
        assert!(format!("{err}").contains("--dp 3 with 2 stages needs 6 ranks, but the job has 4"), "{err}");
        assert_eq!(crate::error::exit_code(&err), 2);
        assert!(Layout::new(4, 1, 1, None).is_ok_and(|l| l.dp == 4));
    }

    #[test]
    fn shard_groups_must_divide_the_replicas() {
        let layout = Layout::new(8, 2, 1, None).unwrap();
        assert_eq!(layout.with_shard_group(None).unwrap(), layout);
        let grouped = layout.with_shard_group(Some(2)).unwrap();
        assert_eq!((grouped.dp_shard, grouped.dp_replicate()), (2, 2));
        assert_eq!(grouped.describe(), "4 replica(s) in 2 shard group(s) of 2 × 2 stages (8 ranks)");
        for size in [1, 3, 8] {
            let err = layout.with_shard_group(Some(size)).unwrap_err();
            assert!(format!("{err}").contains(&format!("--shard-group {size}: shard groups of at least 2 replicas that divide the job's 4")), "{err}");
            assert_eq!(crate::error::exit_code(&err), 2);
        }
    }

    #[test]
    fn a_single_process_has_no_groups_to_talk_over() {
        let world = ProcessGroup::single();
        let groups = Groups::new(&world, Layout::SINGLE).unwrap();
        assert!(groups.dp().is_none() && groups.pp().is_none() && groups.model().is_none());
        assert!(groups.is_root());
        assert!(Groups::new(&world, Layout { dp: 2, ..Layout::SINGLE }).is_err());
    }
}
