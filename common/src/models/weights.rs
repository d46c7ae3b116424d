//! Loading pretrained weights by name (torchvision's `state_dict` names; ImageNet's come from
//! [`super::pretrained`]).
//!
//! The file must hold exactly the model's variables with the model's shapes, with one
//! exception: the head (the classifier's last layer, [`Blocks::head`]) of a file made for
//! another number of classes (ImageNet's 1000) is left out, and the model keeps its freshly
//! initialised head: transfer learning's new classifier on a pretrained backbone. Anything
//! else that does not fit copies nothing and one error lists every difference: a partial load
//! would silently train a half-initialised network.
//!
//! [`Blocks::head`]: super::Blocks::head
use anyhow::{bail, Context};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tch::{nn, Tensor};

use super::blocks::Block;

/// At most this many names per list in the error message.
const MAX_LISTED: usize = 10;

/// torchvision's batch-norm step counter: a buffer tch's batch norm does not have (it takes
/// the momentum from its config), so it is skipped in the file.
const IGNORED_SUFFIX: &str = "num_batches_tracked";

/// What [`load_weights`] copied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadedWeights {
    pub path: PathBuf,
    /// Variables copied from the file.
    pub loaded: usize,
    /// The head's variables, left freshly initialised because the file's head has another
    /// shape (empty when the file's head fits).
    pub new_head: Vec<String>,
}

impl LoadedWeights {
    /// One line for the console.
    pub fn describe(&self) -> String {
        let new = match self.new_head.is_empty() {
            true => String::new(),
            false => format!("; a new head, freshly initialised (the file's is for another number of classes): {}", self.new_head.join(", ")),
        };
        format!("weights: {} tensors loaded from {}{new}", self.loaded, self.path.display())
    }
}

/// Copies the tensors of a `.safetensors` or `.ot` file into the variables of `vs` with the
/// same names: trainable parameters and buffers (batch-norm running statistics) alike,
/// converted to each variable's kind and device. The variables of `head` are left as they are
/// when the file's head has another shape: ImageNet weights (a 1000-class head) start a
/// 10-class model with its own new head.
///
/// Fails, copying nothing, if a variable is missing from the file, a shape outside the head
/// differs, or the file holds tensors the model does not have.
pub fn load_weights(vs: &nn::VarStore, path: &Path, head: &Block) -> anyhow::Result<LoadedWeights> {
    let mut file: BTreeMap<String, Tensor> = read_named_tensors(path)?.into_iter().filter(|(name, _)| !name.ends_with(IGNORED_SUFFIX)).collect();
    if crate::checkpoint::holds_checkpoint(file.keys().map(String::as_str)) {
        let folder = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        bail!(
            "{} is a checkpoint of a run (model and optimizer state), not a weights file: continue that run with --checkpoint-dir {} --resume",
            path.display(),
            folder.display()
        );
    }
    let model: BTreeMap<String, Tensor> = vs.variables().into_iter().collect();
    // The head is new as a whole: a weight of 1000 rows and a bias of 10 would be no head.
    let head_differs = model.iter().any(|(name, var)| head.holds(name) && file.get(name).is_some_and(|t| t.size() != var.size()));
    let new_head: Vec<String> = model.keys().filter(|name| head_differs && head.holds(name)).cloned().collect();

    let mut missing = Vec::new();
    let mut mismatched = Vec::new();
    for (name, var) in model.iter().filter(|(name, _)| !new_head.contains(name)) {
        match file.get(name) {
            None => missing.push(name.clone()),
            Some(t) if t.size() != var.size() => mismatched.push(format!("{name}: file {:?} vs model {:?}", t.size(), var.size())),
            Some(_) => {}
        }
    }
    let unexpected: Vec<String> = file.keys().filter(|name| !model.contains_key(*name)).cloned().collect();
    if !(missing.is_empty() && mismatched.is_empty() && unexpected.is_empty()) {
        let sections = [("missing from the file", &missing), ("shape mismatches", &mismatched), ("unexpected in the file", &unexpected)];
        // One line: binaries print only the first line of an error.
        let details: Vec<String> =
            sections.iter().filter(|(_, names)| !names.is_empty()).map(|(what, names)| format!("{what} ({}): {}", names.len(), capped_list(names))).collect();
        bail!("weights file {} does not fit the model: {}", path.display(), details.join("; "));
    }

    let mut loaded = 0;
    tch::no_grad(|| {
        for (name, var) in model.iter().filter(|(name, _)| !new_head.contains(name)) {
            let src = file.remove(name).expect("checked above");
            // `var` shares storage with the var store, so the in-place copy updates the model.
            var.shallow_clone().copy_(&src.to_device(var.device()).to_kind(var.kind()));
            loaded += 1;
        }
    });
    Ok(LoadedWeights { path: path.to_path_buf(), loaded, new_head })
}

/// Reads all named tensors of a weights file, by its extension.
fn read_named_tensors(path: &Path) -> anyhow::Result<Vec<(String, Tensor)>> {
    // LibTorch opens .safetensors and .ot files itself: a FIFO must not reach it.
    crate::input::check(path, "--weights takes a weights file (a .safetensors, .pth, .pt or .ot file)")?;
    let read = match path.extension().and_then(|ext| ext.to_str()) {
        Some("safetensors") => {
            crate::input::check_safetensors_header(path, "--weights takes a weights file (a .safetensors, .pth, .pt or .ot file)")?;
            Tensor::read_safetensors(path)
        }
        Some("ot") => Tensor::load_multi(path),
        // What Python's torch.save wrote: torchvision's published weights, a state_dict.
        Some("pth" | "pt") => return super::torch_save::read_state_dict(path),
        _ => bail!("weights file {} has an unsupported format: expected a .safetensors, .pth, .pt (torch.save's state_dict) or .ot file", path.display()),
    };
    read.with_context(|| format!("cannot read weights file {}", path.display()))
}

/// `a, b, c` with at most [`MAX_LISTED`] entries, then `... and N more`.
fn capped_list(items: &[String]) -> String {
    let mut list = items.iter().take(MAX_LISTED).cloned().collect::<Vec<_>>().join(", ");
    if items.len() > MAX_LISTED {
        list.push_str(&format!(", ... and {} more", items.len() - MAX_LISTED));
    }
    list
}
