//! What each rank owns of a sharded checkpoint ([`crate::checkpoint::sharded`]): the pieces it
//! writes, and the same description read back into any layout.
//!
//! A rank's tensors are regions of the whole model's: a tensor-parallel shard's cut of each
//! variable, ZeRO's block a flat range of each parameter's (cut), both under their whole-model
//! names. Each element of the model state is written by exactly one rank: a ZeRO block by the
//! rank the strategy names (each replica its own; with HSDP the first shard group's),
//! everything else by replica 0; a tensor every tensor-parallel shard holds whole (a layer norm,
//! a step count) by shard 0. Reading asks the checkpoint for the same
//! regions of this run's layout, whatever the layout that wrote it.
use std::collections::{BTreeSet, HashMap, HashSet};

use anyhow::{Context, Result};
use tch::{Device, Kind, Tensor};

use super::step::{TensorCut, TrainStep};
use crate::checkpoint::region::Region;
use crate::checkpoint::sharded::{Piece, Source};
use crate::optim::block::{BlockLayout, BLOCK_NAME};
use crate::optim::Optimizer;

const MODEL: &str = "model.";
const OPTIM: &str = "optim.";

/// Where this rank's tensors sit among the ranks that hold the same model.
struct Place<'s> {
    cut: Option<&'s dyn TensorCut>,
    first_replica: bool,
    first_shard: bool,
}

impl<'s> Place<'s> {
    fn of(step: &'s dyn TrainStep<'_>) -> Place<'s> {
        let sync = step.sync();
        let cut = sync.tensor_cut();
        Place { cut, first_replica: sync.replica() == 0, first_shard: cut.is_none_or(|cut| cut.shard().0 == 0) }
    }

    /// The region of the whole tensor `name` (a variable, or optimizer state
    /// `<entry>.<variable>`) that this rank's tensor of `dims` dimensions is: the model's cut,
    /// as the step's shards know it.
    fn region(&self, name: &str, dims: usize) -> Result<Region> {
        self.cut.map_or(Ok(Region::WHOLE), |cut| cut.region(name, dims))
    }

    /// Whether this rank writes its piece of `region`: replica 0 does, unless the piece is of a
    /// ZeRO block, which `block_writer` says (whether the strategy has this rank write it).
    fn writes(&self, region: Region, block_writer: Option<bool>) -> bool {
        block_writer.unwrap_or(self.first_replica) && (region.cut.is_some() || self.first_shard)
    }
}

/// Whether the run spreads its model state over ranks (ZeRO, tensor or pipeline parallelism in
/// processes): its checkpoints are then sharded unless asked otherwise.
pub(crate) fn spread(step: &dyn TrainStep<'_>, optimizer: &dyn Optimizer) -> bool {
    let sync = step.sync();
    sync.model().is_some() || sync.tensor_cut().is_some() || optimizer.sharded().is_some_and(|s| s.block_layout().is_some())
}

/// This rank's pieces of the checkpoint: its variables, ZeRO-3's block of the parameters and
/// its optimizer state, each written by one rank only (see the module docs).
pub(crate) fn owned_pieces(step: &dyn TrainStep<'_>, optimizer: &dyn Optimizer) -> Result<Vec<Piece>> {
    let place = Place::of(step);
    let zero3 = step.sync().parameter_block();
    let in_block: HashSet<String> = zero3.as_ref().map(|s| s.layout().params.into_iter().map(|(n, _)| n).collect()).unwrap_or_default();
    let mut pieces = Vec::new();
    for (name, t) in step.named_variables() {
        let region = place.region(&name, t.dim())?;
        if !in_block.contains(&name) && place.writes(region, None) {
            pieces.push(Piece::model(&name, region.whole_shape(&t.size()), region, t.detach()));
        }
    }
    if let Some(shards) = zero3 {
        pieces.extend(block_pieces(&place, &shards.layout(), &shards.block(), shards.writes_block(), &|name| format!("{MODEL}{name}"))?);
    }
    match optimizer.sharded().and_then(|s| Some((s.block_layout()?, s.writes_block()))) {
        Some((layout, writes_block)) => {
            for (key, block) in optimizer.state_tensors() {
                let entry = key.strip_suffix(&format!(".{BLOCK_NAME}")).unwrap_or(&key).to_string();
                if block.dim() == 0 {
                    // A count (Adam's steps), the same for every parameter: under each one's name.
                    for (name, _) in layout.params.iter().filter(|_| place.writes(Region::WHOLE, None)) {
                        pieces.push(Piece::state(&format!("{entry}.{name}"), Vec::new(), Region::WHOLE, block.detach()));
                    }
                    continue;
                }
                pieces.extend(block_pieces(&place, &layout, &block, writes_block, &|name| format!("{OPTIM}{entry}.{name}"))?);
            }
        }
        None => {
            for (key, t) in optimizer.state_tensors() {
                let region = place.region(&key, t.dim())?;
                if place.writes(region, None) {
                    pieces.push(Piece::state(&key, region.whole_shape(&t.size()), region, t.detach()));
                }
            }
        }
    }
    Ok(pieces)
}

/// The spans of a ZeRO `block` as pieces of the tensors `key_of(parameter)`, where this rank
/// writes the block (`writes_block`).
fn block_pieces(place: &Place, layout: &BlockLayout, block: &Tensor, writes_block: bool, key_of: &dyn Fn(&str) -> String) -> Result<Vec<Piece>> {
    let mut pieces = Vec::new();
    for span in &layout.spans {
        let (name, shape) = &layout.params[span.param];
        let cut = place.region(name, shape.len())?;
        let region = cut.flat(span.start, span.len);
        if place.writes(region, Some(writes_block)) {
            let tensor = block.narrow(0, span.offset, span.len);
            pieces.push(Piece { key: key_of(name), shape: cut.whole_shape(shape), region, tensor });
        }
    }
    Ok(pieces)
}

/// Reads this rank's part of `source` (any layout's checkpoint, or a single file) into its
/// variables, ZeRO-3's block and its optimizer; every rank reads its own. Fails, naming the
/// checkpoint, on a variable it lacks or holds in another shape.
pub(crate) fn restore_owned(step: &mut dyn TrainStep<'_>, optimizer: &mut dyn Optimizer, source: &Source) -> Result<()> {
    let what = source.path.display().to_string();
    if optimizer.sharded().is_some_and(|s| !s.over_replicas()) {
        anyhow::bail!(
            "checkpoint {what} is sharded; a parameter-server run resumes from a single file: write one with `checkpoint export`, or resume with the layout that wrote it"
        );
    }
    let place = Place::of(step);
    let zero3 = step.sync().parameter_block();
    let block_layout = zero3.as_ref().map(|s| s.layout());
    let in_block: HashSet<&str> = block_layout.iter().flat_map(|l| l.params.iter().map(|(n, _)| n.as_str())).collect();
    let mut problems = Vec::new();
    let variables = step.named_variables();
    for (name, var) in variables.iter().filter(|(n, _)| !in_block.contains(n.as_str())) {
        let region = place.region(name, var.dim())?;
        match fits(source, &format!("{MODEL}{name}"), region, &var.size()) {
            Err(problem) => problems.push(problem),
            Ok(key) => {
                let saved = source.read(&key, region)?;
                tch::no_grad(|| var.shallow_clone().copy_(&saved));
            }
        }
    }
    for (name, shape) in block_layout.iter().flat_map(|l| &l.params) {
        if let Err(problem) = fits(source, &format!("{MODEL}{name}"), place.region(name, shape.len())?, shape) {
            problems.push(problem);
        }
    }
    if !problems.is_empty() {
        anyhow::bail!("checkpoint {what} does not fit this model: {}", problems.join("; "));
    }
    if let (Some(shards), Some(layout)) = (zero3, &block_layout) {
        shards.load_block(&read_block(source, &place, layout, &|name| format!("{MODEL}{name}"))?)?;
    }
    let state = match optimizer.sharded().and_then(|s| s.block_layout()) {
        Some(layout) => read_state_blocks(source, &place, &layout)?,
        None => read_state(source, &place, &step.named_parameters())?,
    };
    if state.is_empty() {
        return Ok(());
    }
    optimizer.load_state_tensors(&state).with_context(|| format!("checkpoint {what}: optimizer state does not fit"))
}

/// The key of `key` in `source` when this rank's tensor of `local` shape, region `region`, fits
/// it; else the problem, for the error.
fn fits(source: &Source, key: &str, region: Region, local: &[i64]) -> Result<String, String> {
    let name = &key[MODEL.len()..];
    match source.shape(key) {
        None => Err(format!("{name} missing")),
        Some(whole) if region.cut_shape(whole) != local => Err(format!("{name}: checkpoint {whole:?} vs model {:?}", region.whole_shape(local))),
        Some(_) => Ok(key.to_string()),
    }
}

/// A ZeRO block laid out as `layout`, read from the tensors `key_of(parameter)`.
fn read_block(source: &Source, place: &Place, layout: &BlockLayout, key_of: &dyn Fn(&str) -> String) -> Result<Tensor> {
    let block = Tensor::zeros([layout.len], (Kind::Float, Device::Cpu));
    for span in &layout.spans {
        let (name, shape) = &layout.params[span.param];
        let region = place.region(name, shape.len())?.flat(span.start, span.len);
        block.narrow(0, span.offset, span.len).copy_(&source.read(&key_of(name), region)?);
    }
    Ok(block)
}

/// The optimizer-state entries (`exp_avg`) that `source` holds for any of `names`.
fn state_entries<'s>(source: &'s Source, names: &HashSet<&str>) -> BTreeSet<(&'s str, &'s str)> {
    source.keys().filter_map(|key| key.strip_prefix(OPTIM)?.split_once('.')).filter(|(_, variable)| names.contains(variable)).collect()
}

/// A ZeRO optimizer's state from `source`: each entry's block (`<entry>.zero_block`), a count
/// as it is.
fn read_state_blocks(source: &Source, place: &Place, layout: &BlockLayout) -> Result<HashMap<String, Tensor>> {
    let names: HashSet<&str> = layout.params.iter().map(|(n, _)| n.as_str()).collect();
    let entries: BTreeSet<&str> = state_entries(source, &names).into_iter().map(|(entry, _)| entry).collect();
    let mut blocks = HashMap::new();
    for entry in entries {
        let first = format!("{OPTIM}{entry}.{}", layout.params[0].0);
        let block = match source.shape(&first) {
            Some([]) => source.read_whole(&first)?,
            _ => read_block(source, place, layout, &|name| format!("{OPTIM}{entry}.{name}"))?,
        };
        blocks.insert(format!("{entry}.{BLOCK_NAME}"), block);
    }
    Ok(blocks)
}

/// An unsharded optimizer's state for `parameters` from `source`, each cut as its parameter.
fn read_state(source: &Source, place: &Place, parameters: &[(String, Tensor)]) -> Result<HashMap<String, Tensor>> {
    let names: HashSet<&str> = parameters.iter().map(|(n, _)| n.as_str()).collect();
    let mut state = HashMap::new();
    for (entry, variable) in state_entries(source, &names) {
        let name = format!("{entry}.{variable}");
        let key = format!("{OPTIM}{name}");
        let dims = source.shape(&key).map_or(0, <[i64]>::len);
        state.insert(name.clone(), source.read(&key, place.region(&name, dims)?)?);
    }
    Ok(state)
}
