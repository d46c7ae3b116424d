//! What a data-parallel style costs, as the estimator (`--estimate-memory`, [`crate::memory`])
//! and the planner ([`crate::plan`]) ask it: the model state a rank holds, what averaging the
//! gradients holds beside them, the communication of a step, and the layouts the planner may
//! give the style. Each style answers in its own module (its `impl Costs`), so that the
//! estimator and the planner never match on a style: a new style states its costs where it
//! lives. The defaults are plain replicas' (DDP's): the whole model state on every replica, the
//! gradients averaged in buckets by one all-reduce.
//!
//! Bytes are float32's (parameters and gradients 4 bytes each; K bytes of optimizer state per
//! parameter, [`crate::memory::optimizer_bytes_per_parameter`]); "elements" count parameters.
use crate::comm::group::Collective;

/// Bytes of model state one rank holds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StateBytes {
    pub parameters: f64,
    pub gradients: f64,
    pub optimizer: f64,
}

impl StateBytes {
    pub fn total(&self) -> f64 {
        self.parameters + self.gradients + self.optimizer
    }
}

/// One rank's part of a model, as the memory accounting of a style sees it.
#[derive(Debug, Clone, Copy)]
pub struct RankModel<'a> {
    /// This rank's parameters (name, elements), in the order the model lists them (the order
    /// of the gradient averager's and of ZeRO's buckets).
    pub params: &'a [(String, f64)],
    /// The replicas that divide the model state (ZeRO's N; HSDP's shard group), or all of them.
    pub state_shards: usize,
    /// The data-parallel replicas, all of them (HSDP: more than `state_shards`).
    pub replicas: usize,
    /// `--bucket-mb` in bytes.
    pub bucket_bytes: f64,
    /// Bytes per element of the largest parameter that the optimizer's update allocates beside
    /// it ([`crate::memory::update_bytes_per_parameter`]).
    pub update_bytes_per_parameter: f64,
}

impl RankModel<'_> {
    /// The elements of this rank's parameters.
    pub fn psi(&self) -> f64 {
        self.params.iter().map(|(_, n)| n).sum()
    }

    /// The elements of its largest parameter.
    pub fn largest(&self) -> f64 {
        self.params.iter().map(|(_, n)| *n).fold(0.0, f64::max)
    }
}

/// A rank's model state divided over N ranks in buckets, each padded to a multiple of N (ZeRO's
/// `Buckets`): what its collectives and its block hold, in bytes.
#[derive(Debug, Clone, Copy)]
pub struct Sharding {
    n: f64,
    /// The buckets' elements, padded, summed.
    padded_total: f64,
}

impl Sharding {
    /// Buckets of `buckets` elements each, divided over `n` ranks.
    pub fn of(buckets: &[f64], n: usize) -> Sharding {
        let n = n as f64;
        let padded: Vec<f64> = buckets.iter().map(|&elements| (elements / n).ceil() * n).collect();
        Sharding { n, padded_total: padded.iter().sum() }
    }

    /// `elements` padded to a multiple of the ranks.
    pub fn padded(&self, elements: f64) -> f64 {
        (elements / self.n).ceil() * self.n
    }

    /// The rank's block of the parameters, float32.
    pub fn block(&self) -> f64 {
        4.0 * self.padded_total / self.n
    }

    /// Publishing the updated blocks: the all-gather's buffer of every block and the buckets
    /// put together (`Buckets::unblock`).
    pub fn publish(&self) -> f64 {
        2.0 * 4.0 * self.padded_total
    }

    /// Reducing a bucket of `elements` once its gradients are all there: the bucket flattened
    /// (`Buckets::flat`) and this rank's slice of the reduce-scatter, beside the block's
    /// gradient (made at the step's first reduction).
    pub fn reduce(&self, elements: f64) -> f64 {
        4.0 * self.padded(elements) * (1.0 + 1.0 / self.n) + self.block()
    }

    /// Gathering a part of `elements` as its pass starts (parameters sharded): the
    /// all-gather's buffer of every rank's slice, the slices put together (`Buckets::unslice`'s
    /// cat), and the parameters' own storage refilled.
    pub fn gather(&self, elements: f64) -> f64 {
        4.0 * (2.0 * self.padded(elements) + elements)
    }

    /// Starting from replica 0's model, before the first step made any optimizer state: the
    /// variables broadcast whole (`psi` elements of parameters, `buffers` bytes beside them; at
    /// stage 3 gathered for it), then the block refreshed from them (`Shards::refresh_block`:
    /// every bucket flattened, the fresh block beside the block).
    pub fn startup(&self, psi: f64, buffers: f64) -> f64 {
        buffers + 4.0 * psi + 4.0 * self.padded_total + 2.0 * 4.0 * self.padded_total / self.n
    }
}

/// Who a rank talks with in a step's collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Among {
    /// `count` replicas, `stride` replicas apart (1: consecutive ones, as a shard group's).
    Replicas { count: usize, stride: usize },
    /// The parameter servers, ranks outside the replicas' mesh.
    Servers,
}

/// One collective of a data-parallel step: `times` over `bytes` (what each rank puts in).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Talk {
    pub collective: Collective,
    pub among: Among,
    pub bytes: f64,
    pub times: f64,
}

impl Talk {
    /// `times` × `collective` of `bytes` among all `replicas`.
    pub fn replicas(collective: Collective, replicas: usize, bytes: f64, times: f64) -> Talk {
        Talk { collective, among: Among::Replicas { count: replicas, stride: 1 }, bytes, times }
    }
}

/// What a data-parallel style costs (see the module docs). The defaults are plain replicas'.
pub trait Costs {
    /// The model state of one rank holding `psi` parameters of a replica, `k` bytes of
    /// optimizer state per parameter, divided over `n` replicas where the style divides it
    /// (Rajbhandari et al. 2019's accounting with float32 parameters and gradients). Plain
    /// replicas: everything whole, (8 + K)Ψ.
    fn model_state(&self, psi: f64, k: f64, _n: f64) -> StateBytes {
        StateBytes { parameters: 4.0 * psi, gradients: 4.0 * psi, optimizer: k * psi }
    }

    /// The name of [`Costs::model_state`]'s formula, as the results print it.
    fn formula(&self) -> &'static str {
        "(8 + K)Ψ"
    }

    /// Whether each rank updates only its block of the parameters (its optimizer state
    /// divided), so that it clips and steps over that block alone.
    fn state_sharded(&self) -> bool {
        false
    }

    /// Whether a whole model's parameters live sharded, each part gathered for its passes
    /// (ZeRO-3, HSDP): a step that runs the model in stages or shards cannot do that.
    fn parameters_sharded(&self) -> bool {
        false
    }

    /// How the rank's model state is divided over its `state_shards` (ZeRO's buckets), where
    /// the style divides it.
    fn sharding(&self, _rank: &RankModel) -> Option<Sharding> {
        None
    }

    /// A Transformer rank's update after the passes (the activations gone), beside the
    /// parameters and the optimizer state it holds throughout: the `gradients` it holds, their
    /// averaging's buffers and the optimizer's temporaries. Plain replicas: each bucket
    /// flattened (`GradientAverager`'s cat) and the all-reduce's result buffer, or the
    /// optimizer's own temporaries, whichever is larger.
    fn update_bytes(&self, rank: &RankModel, gradients: f64) -> f64 {
        let sync = if rank.state_shards > 1 { 2.0 * 4.0 * average_buckets(rank.params, rank.bucket_bytes).into_iter().fold(0.0, f64::max) } else { 0.0 };
        gradients + sync.max(rank.update_bytes_per_parameter * rank.largest())
    }

    /// An image model's: what averaging the gradients of `psi` parameters over several
    /// replicas holds beside them, in buckets of `bucket` bytes. Plain replicas: a bucket's
    /// flat copy and its average.
    fn averaging_bytes(&self, psi: f64, bucket: f64) -> f64 {
        2.0 * bucket.min(4.0 * psi)
    }

    /// The data-parallel collectives of one step over `replicas` replicas, the state divided
    /// over `state_shards` of them, each rank holding `gradient_bytes` of gradients.
    fn communication(&self, replicas: usize, state_shards: usize, gradient_bytes: f64) -> Vec<Talk>;

    /// The ways the planner may lay the style out over `replicas` replicas, each a shard group
    /// size or None (not grouped); `whole_model`: each rank holds the whole model (no stages or
    /// tensor-parallel shards). Empty: the planner does not lay it out.
    fn shard_groups(&self, _replicas: usize, _whole_model: bool) -> Vec<Option<usize>> {
        Vec::new()
    }
}

/// The gradient averager's buckets of `params` (elements each), in their order: as many
/// consecutive gradients as fit `bucket` bytes, a larger one alone
/// (`comm::data_parallel::GradientAverager`).
fn average_buckets(params: &[(String, f64)], bucket: f64) -> Vec<f64> {
    let mut buckets = Vec::new();
    let mut rest = params;
    while !rest.is_empty() {
        let mut bytes = 0.0;
        let len = rest
            .iter()
            .take_while(|(_, n)| {
                bytes += 4.0 * n;
                bytes <= bucket
            })
            .count()
            .max(1);
        buckets.push(rest[..len].iter().map(|(_, n)| n).sum());
        rest = &rest[len..];
    }
    buckets
}
