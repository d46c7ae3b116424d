//! Loading pretrained weights by name (torchvision's `state_dict` names, see
//! `scripts/export_torchvision_weights.py`).
//!
//! Loading is all or nothing: the file must hold exactly the model's variables with the
//! model's shapes, otherwise nothing is copied and one error lists every difference. A partial
//! load would silently train a half-initialised network.
use anyhow::{bail, Context};
use std::collections::BTreeMap;
use std::path::Path;
use tch::{nn, Tensor};

/// At most this many names per list in the error message.
const MAX_LISTED: usize = 10;

/// torchvision's batch-norm step counter: a buffer tch's batch norm does not have (it takes
/// the momentum from its config), so it is skipped in the file.
const IGNORED_SUFFIX: &str = "num_batches_tracked";

/// Copies the tensors of a `.safetensors` or `.ot` file into the variables of `vs` with the
/// same names: trainable parameters and buffers (batch-norm running statistics) alike,
/// converted to each variable's kind and device.
///
/// Fails, copying nothing, if a variable is missing from the file, a shape differs, or the file
/// holds tensors the model does not have. For example, ImageNet weights (a 1000-class head)
/// do not load into a 10-class model: `fc.weight: file [1000, 512] vs model [10, 512]`.
pub fn load_weights(vs: &nn::VarStore, path: &Path) -> anyhow::Result<()> {
    let mut file: BTreeMap<String, Tensor> = read_named_tensors(path)?
        .into_iter()
        .filter(|(name, _)| !name.ends_with(IGNORED_SUFFIX))
        .collect();
    if crate::checkpoint::holds_checkpoint(file.keys().map(String::as_str)) {
        let folder = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        bail!(
            "{} is a checkpoint of a run (model and optimizer state), not a weights file: continue that run with --checkpoint-dir {} --resume",
            path.display(),
            folder.display()
        );
    }
    let model: BTreeMap<String, Tensor> = vs.variables().into_iter().collect();

    let mut missing = Vec::new();
    let mut mismatched = Vec::new();
    for (name, var) in &model {
        match file.get(name) {
            None => missing.push(name.clone()),
            Some(t) if t.size() != var.size() => mismatched.push(format!(
                "{name}: file {:?} vs model {:?}",
                t.size(),
                var.size()
            )),
            Some(_) => {}
        }
    }
    let unexpected: Vec<String> = file
        .keys()
        .filter(|name| !model.contains_key(*name))
        .cloned()
        .collect();
    if !(missing.is_empty() && mismatched.is_empty() && unexpected.is_empty()) {
        let sections = [
            ("missing from the file", &missing),
            ("shape mismatches", &mismatched),
            ("unexpected in the file", &unexpected),
        ];
        // One line: binaries print only the first line of an error.
        let details: Vec<String> = sections
            .iter()
            .filter(|(_, names)| !names.is_empty())
            .map(|(what, names)| format!("{what} ({}): {}", names.len(), capped_list(names)))
            .collect();
        bail!(
            "weights file {} does not fit the model: {}",
            path.display(),
            details.join("; ")
        );
    }

    tch::no_grad(|| {
        for (name, var) in &model {
            let src = file.remove(name).expect("checked above");
            // `var` shares storage with the var store, so the in-place copy updates the model.
            var.shallow_clone()
                .copy_(&src.to_device(var.device()).to_kind(var.kind()));
        }
    });
    Ok(())
}

/// Reads all named tensors of a weights file, by its extension.
fn read_named_tensors(path: &Path) -> anyhow::Result<Vec<(String, Tensor)>> {
    if !path.is_file() {
        bail!("weights file {} not found", path.display());
    }
    let read = match path.extension().and_then(|ext| ext.to_str()) {
        Some("safetensors") => Tensor::read_safetensors(path),
        Some("ot") => Tensor::load_multi(path),
        _ => bail!(
            "weights file {} has an unsupported format: expected a .safetensors or .ot file",
            path.display()
        ),
    };
    read.with_context(|| format!("cannot read weights file {}", path.display()))
}

/// `a, b, c` with at most [`MAX_LISTED`] entries, then `... and N more`.
fn capped_list(items: &[String]) -> String {
    let mut list = items
        .iter()
        .take(MAX_LISTED)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if items.len() > MAX_LISTED {
        list.push_str(&format!(", ... and {} more", items.len() - MAX_LISTED));
    }
    list
}
